"""Is the rollout making progress, and if not, why: the ``health`` block of ``/admin/status``.

The service samples its counters into an :class:`asyncrl.progress.ProgressWindow`
(``run.progress_window_s``, default 60 s) and :func:`rollout_health` reads them with the
runner's snapshot and the engines' states:

- ``progressing``: tokens were decoded or trajectories published in the window;
- ``finished``: the prompt stream is exhausted and nothing is in flight or in the outbox;
- ``starting``: nothing yet, but the service is younger than the window;
- ``waiting``: nothing moved, but the run's data comes only from sessions
  (``data.source = "sessions"``) and none is in flight: the service waits for its clients;
- ``stalled``: nothing moved for a whole window while work remains.

``stuck`` lists what stands in the way, each ``{"component", "reason"}`` in words, most
likely cause first: no routable engine (each engine's state and reason; a quarantined one
waits for the sync agent to reload it), a pause held longer than ``PAUSE_STUCK_S`` (the sync
agent holds it), admission blocked by the staleness quota or the queue (the trainer must
consume and a sync move the version), an outbox that NATS does not take (the publisher's
last error), generate calls in flight that decode nothing (engines slow or hung), agents
parked on external environments, a verifiers driver that crashed or cannot load its
environment. ``warnings`` lists the same kind of facts while the run
still progresses (an engine out of rotation, a long pause). Pure: no I/O, so every case is
unit-tested on values (tests/rollout/test_run_health.py).
"""

from __future__ import annotations

from typing import Any

from asyncrl.progress import ProgressWindow
from rollout_service.runner.snapshot import RunnerSnapshot

HEALTH_STATES = ("progressing", "starting", "waiting", "finished", "stalled")
PAUSE_STUCK_S = 60.0  # a sync's pause longer than this is reported (sync.pause_timeout_s + a broadcast fit in it normally)


def progress_counters(r: RunnerSnapshot) -> dict[str, float]:
    """The monotonic counters the window samples."""
    return {"tokens_decoded": r.tokens.decoded, "trajectories_finished": r.counters.trajectories_finished,
            "trajectories_published": r.publisher.published, "samples_started": r.counters.samples_started,
            "weight_version": r.version}


def _engine_problems(engines: list[dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    for e in engines:
        if e["state"] == "quarantined":
            out.append({"component": "sync_agent",
                        "reason": f"engine {e['id']} ({e['url']}) is quarantined: {e.get('reason') or 'no reason given'}; "
                                  "the sync agent reloads it (its /status: needs_reload, push_wanted)"})
        elif e["state"] != "healthy":
            out.append({"component": f"engine {e['id']}",
                        "reason": f"engine {e['id']} ({e['url']}) is {e['state']}: {e.get('reason') or 'no reason given'}"})
    return out


def _stuck(r: RunnerSnapshot, engines: list[dict[str, Any]], window_s: float,
           environment: str | None = None) -> list[dict[str, str]]:
    stuck: list[dict[str, str]] = []
    if environment:
        stuck.append({"component": "verifiers driver", "reason": environment})
    routable = [e for e in engines if e["state"] == "healthy"]
    if not engines:
        stuck.append({"component": "engines", "reason": "no engine is registered with the rollout service"})
    elif not routable:
        stuck.append({"component": "engines", "reason": f"no routable engine: all {len(engines)} are out of rotation"})
        stuck.extend(_engine_problems(engines))
    if r.paused and (r.paused_for_s or 0.0) >= PAUSE_STUCK_S:
        stuck.append({"component": "sync_agent",
                      "reason": f"the rollout has been paused ({r.pause_mode}) for {r.paused_for_s:.0f} s by a weight sync; "
                                "see the sync agent's /status (running sync, its phase)"})
    if r.outbox and r.publisher.last_error:
        stuck.append({"component": "nats", "reason": f"{r.outbox} finished trajectories wait in the outbox; publishing to "
                                                     f"JetStream fails: {r.publisher.last_error}"})
    blocked = r.admission_blocked
    if blocked and not r.paused and blocked != "prompt stream exhausted" and r.active == 0:
        who = "trainer" if blocked.startswith("queue full") or r.queued_samples else "sync_agent"
        stuck.append({"component": who,
                      "reason": f"admission blocked: {blocked}; {r.queued_samples} samples wait for the trainer, and new samples "
                                "start after it consumes them and a weight sync moves the version"})
    if r.generating and routable:
        stuck.append({"component": "engines", "reason": f"{r.generating} generate calls in flight but no token decoded in "
                                                        f"{window_s:.0f} s: engine(s) slow or hung"})
    if r.parked and r.parked == r.active:
        stuck.append({"component": "external environments",
                      "reason": f"all {r.parked} trajectories in flight wait for tool results from external environments"})
    if not stuck:
        stuck.append({"component": "rollout_service", "reason": f"no token decoded and nothing published in {window_s:.0f} s, "
                                                                "with no known cause: see the rollout service's log"})
    return stuck


def rollout_health(r: RunnerSnapshot, engines: list[dict[str, Any]], window: ProgressWindow, uptime_s: float,
                   now: float | None = None, environment: str | None = None) -> dict[str, Any]:
    """The ``health`` block (see the module docstring). ``environment``: what is wrong with the
    verifiers driver, if one plays the data and something is (``DriverSupervisor.problem``)."""
    current = progress_counters(r)
    moved = window.deltas(now=now, current=current)
    progress = {k: int(moved.get(k, 0)) for k in current}
    if progress["tokens_decoded"] or progress["trajectories_published"]:
        state = "progressing"
    elif r.prompts.total == 0 and r.active == 0 and r.outbox == 0:
        state = "waiting"  # sessions bring the data (prompts.SessionPrompts) and none is under way
    elif r.prompts.produced >= r.prompts.total and r.active == 0 and r.outbox == 0:
        state = "finished"
    elif uptime_s < window.window_s:
        state = "starting"
    else:
        state = "stalled"
    out: dict[str, Any] = {"state": state, "window_s": window.window_s, "progress": progress,
                           "idle_s": {k: _round(window.idle_for(k, now=now, current=current))
                                      for k in ("tokens_decoded", "trajectories_published")}}
    if state == "stalled":
        out["stuck"] = _stuck(r, engines, window.window_s, environment)
    warnings = _engine_problems(engines)
    if environment and state != "stalled":
        warnings.append({"component": "verifiers driver", "reason": environment})
    if r.paused and (r.paused_for_s or 0.0) >= PAUSE_STUCK_S and state != "stalled":
        warnings.append({"component": "sync_agent", "reason": f"paused for {r.paused_for_s:.0f} s"})
    out["warnings"] = warnings
    return out


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)
