"""Issue 50 item 2: what the engine pool knows of the rollout is one ServingState, built first
and given to the pool and the runner; the runner writes it at restore, pause and resume, and
the pool reads the same object (no closures over a runner bound later)."""

from __future__ import annotations

from rollout_service.serving import ServingState


def test_the_serving_state_follows_pause_and_resume_and_names_the_adapter():
    s = ServingState("run-7", syncs_adapters=True)
    assert (s.version, s.paused, s.holding_calls, s.adapter_route) == (0, False, False, None)  # base model at 0
    s.restored(3)
    assert s.adapter_route is not None and s.adapter_route[1] == 3 and "run-7" in s.adapter_route[0]
    s.pausing()
    assert s.paused and not s.holding_calls  # a drain pause: the gate stays open for a while
    s.hold_calls()
    assert s.holding_calls
    s.resumed(4)
    assert (s.version, s.paused, s.holding_calls, s.adapter_route[1]) == (4, False, False, 4)
    assert ServingState("run-7", syncs_adapters=False).adapter_route is None
