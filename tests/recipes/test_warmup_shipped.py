"""The demo's starting policy ships with the package (asyncrl/models/assets/tiny-arith/, written
by ``python -m recipes.demo.warmup --ship``): it must be what the current code builds.

- Its stamp is the key of the current recipe and code (cheap; fails as soon as a module that
  determines the weights changes without the policy being shipped again).
- Built again from scratch on whatever x86-64 CPU the suite runs (started in the background
  when the suite collects these tests: tests/helpers/shipped_rebuild.py), it is the shipped
  build bit for bit: the build pins the CPU kernels (:mod:`trainer_daemon.compute.portable_numerics`;
  bench/portable_numerics.py shows the same bits natively and on emulated CPUs of other vendors
  and instruction sets). ``./dev test`` rebuilds the first 40 steps (~1 CPU-minute) and
  compares the digest of their weights with the one the shipped build recorded after the same
  steps; ``./dev test-shipped`` rebuilds all 550 (4 minutes alone on 2 cores) and compares every tensor.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from recipes.demo.warmup import (
    DEMO,
    EXPORT_STAMP,
    PREFIX_FILE,
    PREFIX_STEPS,
    recipe_key,
    shipped,
    shipped_dir,
    warm_up,
    weights_digest,
)
from tests.helpers import shipped_rebuild

SHIP = "python -m recipes.demo.warmup --ship"


def test_the_shipped_policy_is_built_by_the_current_code_and_taken_as_it_is():
    stamp = (shipped_dir() / EXPORT_STAMP).read_text().strip()
    assert stamp == recipe_key(DEMO), f"the code that determines the demo's weights changed since it was shipped: run {SHIP}"
    messages: list[str] = []
    assert shipped(DEMO) == shipped_dir() and warm_up(DEMO, messages.append) == shipped_dir() and messages == []
    assert shipped(DEMO.__class__(**{**DEMO.__dict__, "steps": DEMO.steps + 1})) is None  # another recipe is built, not shipped


@pytest.mark.timeout(shipped_rebuild.TIMEOUT_S + 60)  # waits for the background build (bounded by its own timeout)
def test_a_rebuild_reproduces_the_shipped_builds_first_steps_bit_for_bit(request):
    """The digest a build records after its first steps is the same here as in the shipped build
    (the schedule does not depend on the number of steps: a 40-step build's weights are the
    550-step build's after 40), and it is the digest of the weights that build saved."""
    import json

    from asyncrl.models import load_model

    rebuild = shipped_rebuild.start(request.config)  # started at collection (tests/conftest.py)
    built = rebuild.result()
    assert built.is_relative_to(rebuild.cache) and built != shipped_dir()
    mine = json.loads((built / PREFIX_FILE).read_text())
    theirs = json.loads((shipped_dir() / PREFIX_FILE).read_text())
    assert theirs["steps"] == PREFIX_STEPS and len(theirs["sha256"]) == 64
    assert mine == theirs, f"the first {PREFIX_STEPS} steps built here differ from the shipped build's"
    if not shipped_rebuild.full_rebuild():  # the prefix build ends at those steps: its saved weights are them
        assert weights_digest(load_model(str(built))) == mine["sha256"]


@pytest.mark.timeout(shipped_rebuild.TIMEOUT_S + 60)
def test_building_it_again_reproduces_the_shipped_weights(request):
    if not shipped_rebuild.full_rebuild():
        pytest.skip(f"the full rebuild (4 minutes alone, 15-20 CPU-minutes beside the suite) is its own command: ./dev test-shipped "
                    f"({shipped_rebuild.FULL_ENV}=1); ./dev test checks the first {PREFIX_STEPS} steps")
    rebuild = shipped_rebuild.start(request.config)
    built = rebuild.result()
    assert built.is_relative_to(rebuild.cache) and built != shipped_dir()
    mine, theirs = load_file(built / "model.safetensors"), load_file(shipped_dir() / "model.safetensors")
    assert mine.keys() == theirs.keys()
    differ = {k: float((mine[k] - theirs[k]).abs().max()) for k in mine if not torch.equal(mine[k], theirs[k])}
    assert not differ, f"rebuilt weights differ from the shipped ones (max abs diff per tensor): {differ}"
