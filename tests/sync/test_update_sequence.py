"""The one order of a weight update (asyncrl/sync_control/sequence.py), as both the sync agent
and the direct publisher run it: every step in order, a failure contained while the members
are still paused (before release), a cancellation only released. The engines' side of each
step is tested against real engines in test_sync_agent.py and tests/trainer/test_trainer_sync.py;
here a recorder stands in for EngineUpdate to show the order alone."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.sync_control.sequence import UpdateSteps, run_update


class Recorder:
    def __init__(self, calls: list, fail_at: str | None = None) -> None:
        self.calls, self.fail_at = calls, fail_at

    def __getattr__(self, name):
        async def step(*args):
            self.calls.append((name, *args))
            if name == self.fail_at:
                raise RuntimeError(f"{name} failed")
        return step


def steps(calls: list, fail_load=None, form=True) -> UpdateSteps:
    async def load():
        calls.append(("load",))
        if fail_load is not None:
            raise fail_load

    async def form_group():
        calls.append(("form",))

    async def contain(exc):
        calls.append(("contain", str(exc)))

    return UpdateSteps(load=load, form=form_group if form else None, phase=lambda p: calls.append(("phase", p)),
                       contain=contain)


async def test_the_steps_run_in_one_order():
    calls: list = []
    await run_update(Recorder(calls), "abort", 30, steps(calls))
    assert calls == [("pause", "abort"), ("begin",), ("phase", "awaiting_broadcast"), ("form",), ("phase", "loading"),
                     ("load",), ("end",), ("phase", "resuming"), ("flush", 30), ("release",)]
    calls.clear()
    await run_update(Recorder(calls), "retract", 1, steps(calls, form=False))
    assert ("form",) not in calls and calls[-2:] == [("flush", 1), ("release",)]


async def test_an_adapter_sync_opens_no_weight_session():
    """Issue 46 item 8: an adapter's load step only sets the version; ``end_weight_update``
    (0.5.21+) would re-process every base weight inside the pause for nothing."""
    calls: list = []
    adapter = steps(calls, form=False)
    adapter.session = False
    await run_update(Recorder(calls), "abort", 30, adapter)
    assert calls == [("pause", "abort"), ("phase", "awaiting_broadcast"), ("phase", "loading"), ("load",),
                     ("phase", "resuming"), ("flush", 30), ("release",)]


@pytest.mark.parametrize("fail_at", ["pause", "begin", "end", "flush"])
async def test_a_failing_engine_step_is_contained_before_the_release(fail_at):
    calls: list = []
    with pytest.raises(RuntimeError, match=f"{fail_at} failed"):
        await run_update(Recorder(calls, fail_at), "abort", 30, steps(calls))
    assert calls[-2:] == [("contain", f"{fail_at} failed"), ("release",)]


async def test_a_failing_load_is_contained_and_a_cancellation_only_released():
    calls: list = []
    with pytest.raises(ValueError):
        await run_update(Recorder(calls), "abort", 30, steps(calls, fail_load=ValueError("bucket 3 refused")))
    assert calls[-3:] == [("load",), ("contain", "bucket 3 refused"), ("release",)] and ("end",) not in calls
    calls.clear()
    with pytest.raises(asyncio.CancelledError):
        await run_update(Recorder(calls), "abort", 30, steps(calls, fail_load=asyncio.CancelledError()))
    assert calls[-2:] == [("load",), ("release",)]


async def test_the_weights_are_checked_after_end_while_paused_and_a_disagreement_is_contained():
    calls: list = []
    await run_update(Recorder(calls), "abort", 30, steps(calls), check_weights=True)
    assert calls[calls.index(("end",)) + 1] == ("check_weights",) and calls.index(("check_weights",)) < calls.index(("flush", 30))
    calls.clear()
    with pytest.raises(RuntimeError, match="check_weights failed"):
        await run_update(Recorder(calls, "check_weights"), "abort", 30, steps(calls), check_weights=True)
    assert calls[-2:] == [("contain", "check_weights failed"), ("release",)] and ("flush", 30) not in calls
