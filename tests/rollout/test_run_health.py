"""rollout_service.api.run_health: the rollout's ``health`` block on values (no I/O)."""

import dataclasses

from asyncrl.progress import ProgressWindow
from rollout_service.api.run_health import PAUSE_STUCK_S, progress_counters, rollout_health
from rollout_service.publish.publisher import PublisherStats
from rollout_service.runner.accounting import RunnerCounters
from rollout_service.runner.quota import QuotaSnapshot
from rollout_service.runner.snapshot import PromptProgress, RunnerSnapshot, TokenCounts

WINDOW = 60.0


def snap(**kw) -> RunnerSnapshot:
    base = dict(
        version=3, paused=False, pause_mode=None, paused_for_s=None, admission_blocked=None, active=4, parked=0, generating=4,
        partial=0, in_flight_samples=1, queued_samples=0, queued_trajectories=0, max_concurrent_samples=8,
        quota=QuotaSnapshot(3, 8, 8, 1, 1, 0, 7, None), outbox=0, outbox_rejected=0, prompts=PromptProgress(10, 100, 0),
        tokens=TokenCounts(1000, 900, 100), idle_ratio=None, idle_ratio_current=0.0, publisher=PublisherStats(published=20),
        counters=RunnerCounters(samples_started=10, trajectories_finished=20), validation_configured=False, last_validation=None)
    base.update(kw)
    return RunnerSnapshot(**base)


def engine(eid="e-1", state="healthy", reason=None):
    return {"id": eid, "url": f"http://127.0.0.1:1/{eid}", "state": state, "reason": reason, "inflight": 0, "routed": 0,
            "served": 0, "weight_version": "3", "tokens_decoded": 0}


def window_with(r: RunnerSnapshot, age_s: float = 2 * WINDOW) -> ProgressWindow:
    """A window that saw ``r``'s counters unchanged for ``age_s`` seconds, ending at t=1000."""
    w = ProgressWindow(WINDOW)
    t = 1000 - age_s
    while t <= 1000:
        w.observe(progress_counters(r), now=t)
        t += w.interval_s
    return w


def health(r, engines, age_s=2 * WINDOW, window=None):
    return rollout_health(r, engines, window or window_with(r, age_s), uptime_s=age_s, now=1000)


def test_decoding_is_progress():
    r = snap()
    w = window_with(r)
    moved = dataclasses.replace(r, tokens=TokenCounts(1500, 1300, 200))
    h = rollout_health(moved, [engine()], w, uptime_s=500, now=1000)
    assert h["state"] == "progressing" and h["progress"]["tokens_decoded"] == 500
    assert h["idle_s"]["tokens_decoded"] == 0.0 and "stuck" not in h and h["warnings"] == []


def test_young_service_is_starting_not_stalled():
    h = health(snap(), [engine()], age_s=10)
    assert h["state"] == "starting" and "stuck" not in h


def test_every_engine_quarantined_names_the_sync_agent():
    r = snap(generating=0)
    h = health(r, [engine("e-a", "quarantined", "sync agent: failed update to version 4"), engine("e-b", "unhealthy", "timeout")])
    assert h["state"] == "stalled"
    text = " ".join(s["reason"] for s in h["stuck"])
    assert h["stuck"][0] == {"component": "engines", "reason": "no routable engine: all 2 are out of rotation"}
    assert "e-a" in text and "failed update to version 4" in text and "needs_reload" in text
    assert {"sync_agent", "engine e-b"} <= {s["component"] for s in h["stuck"]}


def test_long_pause_points_at_the_sync_agent():
    r = snap(paused=True, pause_mode="partial", paused_for_s=PAUSE_STUCK_S + 30, generating=0, admission_blocked="paused (partial)")
    h = health(r, [engine()])
    assert h["stuck"][0]["component"] == "sync_agent" and "paused (partial) for 90 s" in h["stuck"][0]["reason"]


def test_staleness_quota_names_the_trainer_when_samples_wait():
    r = snap(active=0, generating=0, queued_samples=12,
             admission_blocked="staleness quota: 12 stale samples >= max_required_samples 12")
    h = health(r, [engine()])
    assert h["stuck"][0]["component"] == "trainer" and "admission blocked: staleness quota" in h["stuck"][0]["reason"]


def test_outbox_that_nats_refuses_names_nats():
    r = snap(outbox=7, generating=0, active=0, publisher=PublisherStats(published=20, last_error="nats: no servers available"))
    h = health(r, [engine()])
    assert {"component": "nats", "reason": "7 finished trajectories wait in the outbox; publishing to JetStream fails: "
                                           "nats: no servers available"} in h["stuck"]


def test_calls_in_flight_with_no_tokens_name_the_engines():
    h = health(snap(generating=3), [engine()])
    assert h["stuck"] == [{"component": "engines", "reason": "3 generate calls in flight but no token decoded in 60 s: "
                                                             "engine(s) slow or hung"}]


def test_agents_parked_on_environments():
    h = health(snap(active=2, parked=2, generating=0), [engine()])
    assert h["stuck"][0]["component"] == "external environments"


def test_unknown_cause_is_said_so():
    h = health(snap(generating=0), [engine()])
    assert h["stuck"] == [{"component": "rollout_service", "reason": "no token decoded and nothing published in 60 s, "
                                                                     "with no known cause: see the rollout service's log"}]


def test_finished_run_is_not_stalled():
    h = health(snap(prompts=PromptProgress(100, 100, 0), active=0, generating=0, admission_blocked="prompt stream exhausted"),
               [engine()])
    assert h["state"] == "finished" and "stuck" not in h


def test_engine_out_of_rotation_is_a_warning_while_progressing():
    r = snap()
    w = window_with(r)
    moved = dataclasses.replace(r, tokens=TokenCounts(1100, 1000, 100))
    h = rollout_health(moved, [engine(), engine("e-2", "quarantined", "mixed")], w, uptime_s=500, now=1000)
    assert h["state"] == "progressing" and [x["component"] for x in h["warnings"]] == ["sync_agent"]


def test_a_run_fed_only_by_sessions_is_waiting_not_stalled_when_no_client_comes():
    idle = snap(active=0, generating=0, prompts=PromptProgress(0, 0, 0))  # prompts.SessionPrompts: nothing of its own
    h = health(idle, [engine()])
    assert h["state"] == "waiting" and "stuck" not in h
    assert health(snap(prompts=PromptProgress(0, 0, 0)), [engine()])["state"] == "stalled", \
        "work in flight that does not move is still stalled"
