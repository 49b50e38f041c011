"""sync_agent.health: the tally and the agent's ``health`` block on values (no I/O)."""

import time
from types import SimpleNamespace

from asyncrl.progress import ProgressWindow
from sync_agent.health import PHASE_STUCK_S, SyncTally, agent_health
from sync_agent.records import PlannedGroup, SyncRecord

WINDOW = 60.0


def co(tally=None, running=None, needs_reload=()):
    return SimpleNamespace(tally=tally or SyncTally(), running=running, needs_reload=set(needs_reload))


def view(eid="e-1", alive=True):
    from asyncrl.wire.sync import EngineView

    return EngineView(id=eid, url="http://127.0.0.1:1", rollout_state="healthy", alive=alive, version=3)


def aged_window(tally: SyncTally, age_s: float = 2 * WINDOW) -> ProgressWindow:
    """A window whose samples all show ``tally`` as it is, over the last ``age_s`` seconds."""
    clock = [time.monotonic() - age_s]
    w = ProgressWindow(WINDOW, clock=lambda: clock[0])
    while clock[0] < time.monotonic():
        w.observe(tally.counters())
        clock[0] += w.interval_s
    w.clock = time.monotonic
    return w


def test_tally_counts_outcomes_and_refusals():
    t = SyncTally()
    t.finished("failed", "loading: engine e-1 timed out", 100)
    t.finished("failed", "loading: engine e-1 timed out", 50)
    assert t.consecutive_failures == 2 and t.bytes_moved == 150
    t.finished("succeeded", None, 200)
    t.refuse("stale", "version 3 is older than the engines' version 5")
    assert (t.succeeded, t.failed, t.consecutive_failures, t.refused) == (1, 2, 0, {"stale": 1})
    assert t.counters() == {"syncs_succeeded": 1, "syncs_failed": 2, "refused_stale": 1}


def test_a_success_in_the_window_is_progress():
    c = co()
    w = aged_window(c.tally)
    c.tally.finished("succeeded", None)
    h = agent_health(c, [view()], False, w, uptime_s=500)
    assert h["state"] == "progressing" and h["progress"]["syncs_succeeded"] == 1 and "stuck" not in h


def test_nothing_asked_and_nothing_wrong_is_idle():
    c = co()
    h = agent_health(c, [view()], False, aged_window(c.tally), uptime_s=500)
    assert h["state"] == "idle" and "stuck" not in h and "warnings" not in h


def test_a_stale_loop_names_the_trainer():
    c = co()
    w = aged_window(c.tally)
    for _ in range(5):
        c.tally.refuse("stale", "version 3 is older than the engines' version 7")
    h = agent_health(c, [view()], False, w, uptime_s=500)
    assert h["state"] == "stalled"
    (s,) = h["stuck"]
    assert s["component"] == "trainer" and s["reason"].startswith("5 sync request(s) refused (stale): version 3 is older")


def test_failures_in_a_row_show_the_last_error():
    c = co()
    w = aged_window(c.tally)
    c.tally.finished("failed", "loading: engine e-2 did not confirm bucket 3")
    c.tally.finished("failed", "loading: engine e-2 did not confirm bucket 3")
    h = agent_health(c, [view()], False, w, uptime_s=500)
    assert h["state"] == "stalled" and h["consecutive_failures"] == 2
    assert "2 sync(s) failed in the window, 2 in a row; last error: loading: engine e-2" in h["stuck"][0]["reason"]


def test_push_wanted_names_the_trainer_at_once():
    c = co(needs_reload=["e-1"])
    h = agent_health(c, [view()], True, aged_window(c.tally, age_s=5), uptime_s=5)
    assert h["state"] == "stalled" and h["stuck"][0]["component"] == "trainer"
    assert "full weights" in h["stuck"][0]["reason"]


def test_a_phase_held_too_long_names_where():
    group = PlannedGroup(master_address="127.0.0.1", master_port=29500, world_size=2, members={"e-1": 1},
                         urls={"e-1": "http://127.0.0.1:30000"})
    rec = SyncRecord(version=4, group=group, buckets=[])
    rec.state, rec.phase_started_at = "awaiting_broadcast", time.time() - PHASE_STUCK_S - 5
    c = co(running=rec)
    h = agent_health(c, [view()], False, aged_window(c.tally), uptime_s=500)
    assert h["state"] == "stalled"
    assert h["stuck"][0]["component"] == "trainer" and "in phase 'awaiting_broadcast' for 65 s" in h["stuck"][0]["reason"]


def test_engines_awaiting_reload_are_a_warning_while_syncs_succeed():
    c = co(needs_reload=["e-2"])
    w = aged_window(c.tally)
    c.tally.finished("succeeded", None)
    h = agent_health(c, [view(), view("e-2")], False, w, uptime_s=500)
    assert h["state"] == "progressing" and h["warnings"][0]["component"] == "engines" and "e-2" in h["warnings"][0]["reason"]


def test_unreachable_rollout_service_is_said():
    c = co()
    h = agent_health(c, [], False, aged_window(c.tally), uptime_s=500, rollout_error="connection refused")
    assert h["state"] == "stalled"
    assert h["stuck"] == [{"component": "rollout_service", "reason": "the rollout service does not answer the agent: "
                                                                     "connection refused"}]
