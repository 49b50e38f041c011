"""The demo's starting policy ships with the package (asyncrl/models/assets/tiny-arith/, written
by ``python -m recipes.demo.warmup --ship``): it must be what the current code builds.

- Its stamp is the key of the current recipe and code (cheap; fails as soon as a module that
  determines the weights changes without the policy being shipped again).
- Built again from scratch (``python -m recipes.demo.warmup --rebuild``, started in the
  background when the suite collects this test: tests/helpers/shipped_rebuild.py), the policy
  is the shipped one tensor for tensor, on whatever x86-64 CPU the suite runs: the build pins
  the CPU kernels (:mod:`trainer_daemon.portable_numerics`; bench/portable_numerics.py shows
  the same bits natively and on emulated CPUs of other vendors and instruction sets). ~3
  CPU-minutes.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from recipes.demo.warmup import DEMO, EXPORT_STAMP, recipe_key, shipped, shipped_dir, warm_up
from tests.helpers import shipped_rebuild

SHIP = "python -m recipes.demo.warmup --ship"


def test_the_shipped_policy_is_built_by_the_current_code_and_taken_as_it_is():
    stamp = (shipped_dir() / EXPORT_STAMP).read_text().strip()
    assert stamp == recipe_key(DEMO), f"the code that determines the demo's weights changed since it was shipped: run {SHIP}"
    messages: list[str] = []
    assert shipped(DEMO) == shipped_dir() and warm_up(DEMO, messages.append) == shipped_dir() and messages == []
    assert shipped(DEMO.__class__(**{**DEMO.__dict__, "steps": DEMO.steps + 1})) is None  # another recipe is built, not shipped


@pytest.mark.timeout(shipped_rebuild.TIMEOUT_S + 60)  # waits for the background build (bounded by its own timeout)
def test_building_it_again_reproduces_the_shipped_weights(request):
    rebuild = shipped_rebuild.start(request.config)  # started at collection (tests/conftest.py)
    built = rebuild.result()
    assert built.is_relative_to(rebuild.cache) and built != shipped_dir()
    mine, theirs = load_file(built / "model.safetensors"), load_file(shipped_dir() / "model.safetensors")
    assert mine.keys() == theirs.keys()
    differ = {k: float((mine[k] - theirs[k]).abs().max()) for k in mine if not torch.equal(mine[k], theirs[k])}
    assert not differ, f"rebuilt weights differ from the shipped ones (max abs diff per tensor): {differ}"
