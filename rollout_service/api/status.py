"""The JSON status of the rollout service (``GET /admin/status``, and the answer of every
admin action)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from rollout_service.agent.state import Phase


def service_status(svc) -> dict[str, Any]:
    r = svc.runner
    parked_partial = sum(1 for s in r.agents.values() if s.phase == Phase.GENERATING and s.segment > 0)
    return {
        "run_id": svc.cfg.run.id,
        "version": r.version,
        "paused": r.paused,
        "pause_mode": r.pause_mode,
        "uptime_s": round(time.time() - svc.started_at, 3),
        "counts": {
            "active": r.active_trajectories,
            "generating": r._generating,
            "partial": parked_partial,
            "in_flight_samples": r.in_flight_samples,
            "queued_samples": r.queued_samples,
            "queued_trajectories": r.queued_trajectories,
            "stale": r.quota.staleness_samples,
            "outbox": len(r.outbox),
            "outbox_rejected": r.outbox.rejected_count(),
        },
        "quota": dataclasses.asdict(r.quota.snapshot(r.queued_samples)),
        "admission_blocked": r.admission_blocker(),
        "prompts": {"produced": r.stream.produced, "total": r.stream.total, "epoch": r.stream.epoch},
        "tokens": {"decoded": r.tokens.decoded, "kept": r.tokens.kept, "wasted": r.tokens.wasted},
        "rollouter": {"idle_ratio": r.clock.last_idle_ratio, "idle_ratio_current": round(r.clock.current_idle_ratio(), 4)},
        "publisher": dataclasses.asdict(r.publisher.stats),
        "counters": dataclasses.asdict(r.counters),
        "tools": dataclasses.asdict(svc.tools.stats),
        "engines": svc.pool.snapshot(),
        "derived": svc.cfg.derived.model_dump(),
    }
