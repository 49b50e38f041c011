"""Are weight syncs getting through, and if not, why: the ``health`` block of ``GET /status``.

:class:`SyncTally` counts what happened to every sync request since the agent started
(succeeded, failed, refused by reason), independently of the bounded list of records (so
the counts and the Prometheus counters built on them keep counting when old records go).
The agent samples it into an :class:`asyncrl.progress.ProgressWindow`
(``run.progress_window_s``) and :func:`agent_health` reads both:

- ``progressing``: a sync succeeded in the window;
- ``idle``: no sync was asked for in the window and nothing is wrong (the trainer is between
  publishes: it asks at every ``trigger_parameter_sync_step``);
- ``starting``: the agent is younger than the window and nothing is wrong;
- ``stalled``: something below holds the run: ``stuck`` says what, each
  ``{"component", "reason"}`` in words, worst first: a sync stuck in one phase longer than
  ``PHASE_STUCK_S``, engines waiting for the trainer's full weights (``push_wanted``),
  engines waiting for a reload, syncs failing (the last error), requests refused (by reason,
  e.g. ``stale``: the trainer publishes versions behind the engines').

Pure functions over values plus the tally's counters; no I/O (tests/sync/test_sync_health.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from asyncrl.progress import ProgressWindow
from asyncrl.wire.sync import EngineView

PHASE_STUCK_S = 60.0  # a sync phase longer than this is reported (pause, group and broadcast timeouts are each shorter by default)

REFUSAL_COMPONENT = {"stale": "trainer", "no_engines": "engines", "recovering": "sync_agent", "regroup": "trainer",
                     "layout": "engines", "nccl_mismatch": "engines", "pause_policy": "engines"}
REFUSAL_HINT = {
    "stale": "the trainer asks for versions older than the engines'; it moves past them when told (trainer log: 'stale')",
    "no_engines": "no engine answers; see the rollout service's /admin/status engines",
    "recovering": "the agent is still finishing a sync its previous process left; see the reconcile log lines",
    "regroup": "the engines changed since the weight group was formed; the trainer forms a new group on its next push",
    "pause_policy": "an engine's sglang release cannot run sync.pause_policy honestly (no weight_versions spans before "
                    "0.5.19): use pause_policy=abort or upgrade it",
}


@dataclass
class SyncTally:
    """Outcomes of sync requests since the agent started (see the module docstring)."""

    succeeded: int = 0
    failed: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    consecutive_failures: int = 0
    last_error: str | None = None
    last_refusal: tuple[str, str] | None = None
    """(code, message) of the newest refusal."""
    last_success_at: float | None = None
    bytes_moved: int = 0
    """Bytes of weights moved by finished syncs."""

    def finished(self, state: str, error: str | None, nbytes: int = 0) -> None:
        self.bytes_moved += nbytes
        if state == "succeeded":
            self.succeeded += 1
            self.consecutive_failures = 0
            self.last_success_at = time.time()
        elif state == "failed":
            self.failed += 1
            self.consecutive_failures += 1
            self.last_error = error

    def refuse(self, code: str, message: str) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1
        self.last_refusal = (code, message)

    def counters(self) -> dict[str, float]:
        return {"syncs_succeeded": self.succeeded, "syncs_failed": self.failed,
                **{f"refused_{code}": n for code, n in self.refused.items()}}


def _stuck(co, views: list[EngineView], push_wanted: bool, moved: dict[str, float], now: float,
           rollout_error: str | None) -> list[dict[str, str]]:
    stuck: list[dict[str, str]] = []
    if rollout_error:
        stuck.append({"component": "rollout_service", "reason": f"the rollout service does not answer the agent: {rollout_error}"})
    rec = co.running
    if rec is not None and now - rec.phase_started_at >= PHASE_STUCK_S:
        where = {"staging": "engines", "pausing": "rollout_service", "awaiting_broadcast": "trainer", "loading": "trainer",
                 "resuming": "engines", "failing": "engines"}.get(rec.state, "sync_agent")
        stuck.append({"component": where, "reason": f"sync {rec.id} (version {rec.version}) has been in phase {rec.state!r} "
                                                    f"for {now - rec.phase_started_at:.0f} s"})
    if push_wanted:
        stuck.append({"component": "trainer", "reason": "the engines wait for the trainer's full weights (quarantined, nothing "
                                                        "to reload from); an idle trainer pushes within seconds of asking"})
    waiting = sorted(co.needs_reload)
    if waiting and not push_wanted:
        stuck.append({"component": "engines", "reason": f"engine(s) {', '.join(waiting)} may hold mixed weights and are "
                                                        "quarantined until a reload succeeds (reconcile loop)"})
    if moved.get("syncs_failed") and co.tally.last_error:
        stuck.append({"component": "sync_agent",
                      "reason": f"{int(moved['syncs_failed'])} sync(s) failed in the window, {co.tally.consecutive_failures} in "
                                f"a row; last error: {co.tally.last_error} (GET /v1/syncs)"})
    for key, n in sorted(moved.items()):
        if key.startswith("refused_") and n:
            code = key.removeprefix("refused_")
            last = co.tally.last_refusal[1] if co.tally.last_refusal and co.tally.last_refusal[0] == code else ""
            stuck.append({"component": REFUSAL_COMPONENT.get(code, "sync_agent"),
                          "reason": f"{int(n)} sync request(s) refused ({code}): {last}. {REFUSAL_HINT.get(code, '')}".rstrip(". ")})
    if not rollout_error and not any(v.alive for v in views):
        stuck.append({"component": "engines", "reason": "no live engine behind the rollout service"})
    return stuck


def agent_health(co, views: list[EngineView], push_wanted: bool, window: ProgressWindow, uptime_s: float,
                 now: float | None = None, rollout_error: str | None = None) -> dict[str, Any]:
    """The ``health`` block (see the module docstring). ``now``: wall-clock seconds;
    ``rollout_error``: why the rollout service did not answer (``views`` is then empty)."""
    now = time.time() if now is None else now
    current = co.tally.counters()
    moved = window.deltas(current=current)
    attempts = sum(v for k, v in moved.items() if k != "syncs_succeeded")
    stuck = _stuck(co, views, push_wanted, moved, now, rollout_error)
    if moved.get("syncs_succeeded"):
        state = "progressing"
    elif stuck and (uptime_s >= window.window_s or push_wanted or co.running is not None):
        state = "stalled"
    elif uptime_s < window.window_s:
        state = "starting"
    else:
        state = "idle" if not attempts and not stuck else "stalled"
    out: dict[str, Any] = {"state": state, "window_s": window.window_s, "progress": {k: int(v) for k, v in moved.items()},
                           "idle_s": {"syncs_succeeded": _round(window.idle_for("syncs_succeeded", current=current))},
                           "consecutive_failures": co.tally.consecutive_failures}
    if state == "stalled":
        out["stuck"] = stuck
    elif stuck:
        out["warnings"] = stuck
    return out


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)
