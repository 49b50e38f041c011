"""The status of the rollout service (``GET /admin/status``, and the answer of every admin
action: :class:`asyncrl.wire.rollout_admin.RolloutStatus`), and verl's metrics document —
both read from one :class:`RunnerSnapshot`."""

from __future__ import annotations

import dataclasses
from typing import Any

from asyncrl.wire.rollout_admin import RolloutStatus
from rollout_service.runner.snapshot import RunnerSnapshot


def service_status(*, run_id: str, uptime_s: float, r: RunnerSnapshot, engines: list[dict], health: dict,
                   sessions_open: int, sessions_expired: int, tools: Any, derived: dict,
                   environment: dict | None) -> RolloutStatus:
    """The status document from its parts (the service gathers them: ``RolloutService.status``)."""
    return RolloutStatus.model_validate({
        "run_id": run_id,
        "version": r.version,
        "paused": r.paused,
        "pause_mode": r.pause_mode,
        "paused_for_s": r.paused_for_s,
        "uptime_s": round(uptime_s, 3),
        "health": health,
        "counts": {
            "active": r.active,
            "parked": r.parked,
            "sessions_open": sessions_open,
            "sessions_expired": sessions_expired,
            "generating": r.generating,
            "partial": r.partial,
            "in_flight_samples": r.in_flight_samples,
            "queued_samples": r.queued_samples,
            "queued_trajectories": r.queued_trajectories,
            "stale": r.quota.staleness_samples,
            "outbox": r.outbox,
            "outbox_rejected": r.outbox_rejected,
        },
        "quota": dataclasses.asdict(r.quota),
        "admission_blocked": r.admission_blocked,
        "prompts": dataclasses.asdict(r.prompts),
        "tokens": dataclasses.asdict(r.tokens),
        "rollouter": {"idle_ratio": r.idle_ratio, "idle_ratio_current": round(r.idle_ratio_current, 4)},
        "publisher": dataclasses.asdict(r.publisher),
        "counters": dataclasses.asdict(r.counters),
        "tools": dataclasses.asdict(tools),
        "engines": engines,
        "derived": derived,
        "last_validation": r.last_validation,
        "last_pause": r.last_pause,
        "environment": environment,
    })


def verl_metrics(r: RunnerSnapshot) -> dict[str, float]:
    """The rollout's numbers under verl's metric names (published on the metrics subject)."""
    return {
        "rollouter/idle_ratio": r.idle_ratio if r.idle_ratio is not None else float("nan"),
        "rollouter/idle_ratio_current": r.idle_ratio_current,
        "count/current_param_version": r.version,
        "count/total_generated_samples": r.counters.samples_started,
        "count/staleness_samples": r.quota.staleness_samples,
        "static/max_required_samples": r.quota.max_required_samples,
        "static/max_queue_size": r.quota.max_queue_size,
        "static/max_concurrent_samples": r.max_concurrent_samples,
        "monitor/active_tasks_size": r.active,
        "monitor/queue/mq_queue_size": r.queued_samples,
        "rollout/trajectories_finished": r.counters.trajectories_finished,
        "rollout/partial_trajectories": r.counters.partial_trajectories,
        "rollout/tokens_decoded": r.tokens.decoded,
        "rollout/tokens_wasted": r.tokens.wasted,
        "rollout/outbox": r.outbox,
        **{f"rollout/per_request/{outcome}": r.counters.per_request_calls.get(outcome, 0)
           for outcome in ("kept", "resumed", "cancelled", "missed")},
        "rollout/per_request/reprefill_tokens": r.counters.reprefill_tokens,
        "rollout/per_request/pause_s": r.counters.last_per_request_pause_s,
        "rollout/stale_cancelled_tokens": r.counters.stale_cancelled_tokens,
        "rollout/stale_token_share": r.counters.stale_cancelled_tokens / r.tokens.decoded if r.tokens.decoded else 0.0,
        "rollout/cancelled_samples": r.counters.cancelled_samples,
        "rollout/quota_credited_samples": r.counters.quota_credits,
    }
