"""Models as directories for real SGLang (it loads only from a path): ``builtin:tiny`` (built in
code, the model of most tests, with its tokenizer) saved once into the cache, so SGLang serves
exactly the weights local_engine serves for ``builtin:tiny`` and tests that compare with it
(teacher forcing, peft adapters on it) run unchanged against SGLang."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from asyncrl.models.cache import MARKER, build_once
from tests.sglang_cpu.install import cache_root

TINY = "builtin:tiny"


def tiny_model_dir() -> Path:
    """``builtin:tiny`` (seed 0: local_engine's default) as a Hugging Face directory."""
    return build_once(cache_root() / "models" / "tiny", lambda out: _save(TINY, out))


def tiny_moe_dir() -> Path:
    """``builtin:tiny-moe`` (seed 0) as a Hugging Face directory (checkpoint names: one matrix per
    expert), keyed by the module that defines it."""
    import hashlib

    import asyncrl.models.builtin_moe as builtin_moe

    key = hashlib.sha256(Path(builtin_moe.__file__).read_bytes()).hexdigest()[:12]
    return build_once(cache_root() / "models" / f"tiny-moe-{key}", lambda out: _save(TINY_MOE, out))


TINY_MOE = "builtin:tiny-moe"


def _save(spec: str, out: Path) -> None:
    from asyncrl.models import load_model, load_tokenizer

    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".save-") as tmp:
        stage = Path(tmp) / "model"
        load_model(spec).save_pretrained(stage, safe_serialization=True)
        load_tokenizer(spec).save_pretrained(stage)
        (stage / MARKER).write_text(spec + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(stage, out)
