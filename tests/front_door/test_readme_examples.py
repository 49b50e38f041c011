"""Each ``examples/*.toml`` the README names, started as the README types it
(``./dev up examples/<x>.toml``, with only ``run.dir`` added), takes a first trainer step and
stops cleanly on Ctrl-C (issue 64). SmolLM2-135M comes from the cache the suite's other
SmolLM2 tests fill (converted from its PyPI wheel on first use).
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.user_runs import REPO, DevUp, children_left

EXAMPLE_FIRST_STEP_S = 900.0  # SmolLM2-135M: the model's conversion on a cold cache, validation, one step
STOP_S = 90.0


def readme_examples() -> list[str]:
    """The example configs the README tells users to run (``./dev up examples/<x>.toml``)."""
    found = sorted(set(re.findall(r"\./dev up (examples/[\w.-]+\.toml)", (REPO / "README.md").read_text())))
    assert found, "the README names no example config"
    return found



@pytest.mark.timeout(EXAMPLE_FIRST_STEP_S + STOP_S + 120)
@pytest.mark.parametrize("example", readme_examples())
def test_each_readme_example_starts_trains_a_step_and_stops(tmp_path, example):
    run = DevUp.start(tmp_path / "run", example)
    try:
        run.wait_until(lambda: run.steps() >= 1, EXAMPLE_FIRST_STEP_S, "the first trainer step")
        run.ctrl_c()
        rc, out = run.finish(STOP_S)
        assert rc == 0, out[-4000:]
        summary = run.summary()
        assert summary["stopped_because"] == "interrupted" and summary["trainer_steps"] >= 1, summary
        assert children_left(run.run_dir) == []
    finally:
        run.kill()
