"""A warmed-up builtin:tiny for tests that need tool calls: the trainer's warm-up
(:func:`recipes.demo.warmup.warm_up`) with a short recipe — format only: it calls the
calculator and answers in a box, not reliably correctly.

Built once and cached under ``$ASYNCRL_CACHE_DIR/models`` keyed by the recipe and the code
that determines it; a file lock keeps parallel test processes from building it twice.
"""

from __future__ import annotations

import functools
from pathlib import Path

from asyncrl.models.cache import MARKER
from recipes.demo.warmup import WarmupRecipe, cached_dir, warm_up

# 120 steps: enough for the format (tool call, boxed answer); copying digits needs far more.
TEST_RECIPE = WarmupRecipe(name="tiny-arith-test", tools=("calculator",), exact_fraction=1.0, level=None,
                           steps=120, batch_size=16, lr=3e-3, examples=1000)


def warm_tiny_model() -> Path:
    return warm_up(TEST_RECIPE, progress=lambda message: None)


@functools.cache
def _cached_dir() -> Path:
    """The build's directory: its key hashes the code that determines it, read once per process."""
    return cached_dir(TEST_RECIPE)


def warm_model_built() -> bool:
    """Whether the cache already holds the finished build (a test using it waits for nothing).
    Asked before every test that uses the model: one file check."""
    return (_cached_dir() / MARKER).is_file()
