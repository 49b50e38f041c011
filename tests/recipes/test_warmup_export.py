"""``python -m recipes.demo.warmup --export DIR`` (compose's model-init): the warmed-up model
copied into a models directory once, complete and readable by every component."""

from __future__ import annotations

import subprocess
import sys

from asyncrl.models import load_model, load_tokenizer
from recipes.demo.warmup import EXPORT_STAMP, export, recipe_key
from tests.helpers.warm_model import TEST_RECIPE


def test_export_copies_the_build_once_and_replaces_a_stale_one(tmp_path):
    dest = tmp_path / "models" / "tiny-arith"
    messages = []
    assert export(TEST_RECIPE, dest, messages.append) == dest
    assert (dest / EXPORT_STAMP).read_text().strip() == recipe_key(TEST_RECIPE)
    assert load_tokenizer(str(dest)).encode("2+2") and load_model(str(dest)) is not None
    assert all(oct(p.stat().st_mode)[-3:] in ("644", "755") for p in dest.rglob("*"))
    assert [p.name for p in dest.parent.iterdir()] == ["tiny-arith"]  # no temporary left behind

    weights = next(dest.glob("*.safetensors"))
    before = weights.stat().st_mtime_ns
    export(TEST_RECIPE, dest, messages.append)
    assert weights.stat().st_mtime_ns == before and "already holds" in messages[-1]

    (dest / EXPORT_STAMP).write_text("an-older-recipe\n")
    (dest / "leftover.txt").write_text("from the older build")
    export(TEST_RECIPE, dest, messages.append)
    assert (dest / EXPORT_STAMP).read_text().strip() == recipe_key(TEST_RECIPE)
    assert not (dest / "leftover.txt").exists()


def test_export_flag_is_in_the_command_line():
    out = subprocess.run([sys.executable, "-m", "recipes.demo.warmup", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--export DIR" in out.stdout
