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
    s.pausing("drain")
    assert s.paused and not s.holding_calls and s.pause_mode == "drain" and s.paused_at is not None  # the gate open a while
    started = s.paused_at
    s.pausing("drain")  # a repeated pause keeps its start
    assert s.paused_at == started
    s.hold_calls()
    assert s.holding_calls
    s.resumed(4)
    assert (s.version, s.paused, s.holding_calls, s.adapter_route[1]) == (4, False, False, 4)
    assert (s.pause_mode, s.paused_at) == (None, None)
    assert ServingState("run-7", syncs_adapters=False).adapter_route is None


def test_the_pace_of_versions_is_measured_from_the_resumes(monkeypatch):
    """``seconds_per_version`` (the per-request rule's projection): the time between resumes to
    a new version, per version; a resume at the same version does not count."""
    import rollout_service.serving as serving_mod

    clock = [100.0]
    monkeypatch.setattr(serving_mod.time, "monotonic", lambda: clock[0])
    state = serving_mod.ServingState()
    state.resumed(1)
    assert state.seconds_per_version is None, "one resume: no interval yet"
    clock[0] = 104.0
    state.resumed(1)  # the same version again: not a new one
    clock[0] = 106.0
    state.resumed(3)  # two versions in 6 s
    assert state.seconds_per_version == 3.0
    clock[0] = 116.0
    state.resumed(4)
    assert abs(state.seconds_per_version - (0.7 * 3.0 + 0.3 * 10.0)) < 1e-9
