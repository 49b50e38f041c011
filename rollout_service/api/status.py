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
            "parked": r.parked_trajectories,
            "sessions_open": svc.sessions.open_count,
            "sessions_expired": svc.sessions.expired_total,
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
        "last_validation": r.last_validation,
    }


def verl_metrics(svc) -> dict[str, float]:
    """The rollout's numbers under verl's metric names (published on the metrics subject)."""
    r = svc.runner
    return {
        "rollouter/idle_ratio": r.clock.last_idle_ratio if r.clock.last_idle_ratio is not None else float("nan"),
        "rollouter/idle_ratio_current": r.clock.current_idle_ratio(),
        "count/current_param_version": r.version,
        "count/total_generated_samples": r.counters.samples_started,
        "count/staleness_samples": r.quota.staleness_samples,
        "static/max_required_samples": r.quota.max_required_samples,
        "static/max_queue_size": r.quota.max_queue_size,
        "static/max_concurrent_samples": r.max_concurrent,
        "monitor/active_tasks_size": r.active_trajectories,
        "monitor/queue/mq_queue_size": r.queued_samples,
        "rollout/trajectories_finished": r.counters.trajectories_finished,
        "rollout/partial_trajectories": r.counters.partial_trajectories,
        "rollout/tokens_decoded": r.tokens.decoded,
        "rollout/tokens_wasted": r.tokens.wasted,
        "rollout/outbox": len(r.outbox),
    }
