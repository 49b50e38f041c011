"""Prometheus metrics of the rollout service, read from the live objects at scrape time.

Names follow verl where verl has one, with ``/`` → ``_`` and an ``asyncrl_`` prefix
(Prometheus names cannot contain ``/``):

| Prometheus | verl |
|---|---|
| ``asyncrl_rollouter_idle_ratio`` | ``rollouter/idle_ratio`` (last completed version) |
| ``asyncrl_rollouter_staleness_samples`` | ``count/staleness_samples`` |
| ``asyncrl_rollouter_max_required_samples`` | ``static/max_required_samples`` |
| ``asyncrl_rollouter_partial_trajectories_total`` | trajectories whose tokens span > 1 version |

plus throughput, tokens, tool calls, turns, queue and outbox gauges, engines by state
(``asyncrl_rollout_engines{state}``) and the health block as ``asyncrl_rollout_health{state}``
(1 for the current state), ``asyncrl_rollout_idle_seconds``, the seconds each engine spent
quarantined at the current version (``asyncrl_rollout_engine_quarantined_current_seconds_total``)
and the run's NATS stores (``asyncrl_nats_store_messages`` / ``_bytes{store}``); per-request
pauses (``sync.pause_policy = "per_request"``): calls by outcome
(``asyncrl_rollout_per_request_calls_total{outcome}``: kept, resumed, cancelled, missed), the
context tokens resumed calls prefill again (``asyncrl_rollout_reprefill_tokens_total``), the
last pause's decision time (``asyncrl_rollout_per_request_pause_seconds``), and, whatever the
policy, tokens decoded by trajectories cancelled for staleness
(``asyncrl_rollout_stale_cancelled_tokens_total``, their share of every decoded token
``asyncrl_rollout_stale_token_share``) and samples cancelled whole
(``asyncrl_rollout_cancelled_samples_total``) (alert rules:
docker/prometheus/alerts.yml). Each app has its own
``CollectorRegistry`` (no global state). The collector reads only its
:class:`MetricsSources` (the service builds them: ``RolloutService.metrics_sources``); the
runner's numbers come from one :meth:`Runner.snapshot` per scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollout_service.api.run_health import HEALTH_STATES

ENGINE_STATES = ("healthy", "unhealthy", "quarantined")


@dataclass(frozen=True)
class MetricsSources:
    """What the collector reads at each scrape, and nothing else."""

    snapshot: Callable[[], Any]
    """The runner's :class:`~rollout_service.runner.snapshot.RunnerSnapshot` now."""
    health: Callable[[Any], dict]
    """The health block for a snapshot (:mod:`rollout_service.api.run_health`)."""
    engines: Callable[[], Iterable[Any]]
    """The engine pool's handles (id, state, inflight, quarantined_current_s)."""
    store_sizes: Callable[[], dict[str, dict[str, int]]]
    tool_stats: Callable[[], Any]
    environment: Callable[[], dict | None]
    """The verifiers driver's status, or None without one."""
    collectors: tuple = ()
    """Collectors of their own (the publisher's latency histograms, the event-loop lag)."""


class RolloutCollector:
    def __init__(self, sources: MetricsSources) -> None:
        self.sources = sources

    def collect(self):
        src = self.sources
        r = src.snapshot()
        c = r.counters

        def gauge(name, doc, value, labels=None):
            g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
            g.add_metric(list((labels or {}).values()), float(value))
            return g

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc)
            m.add_metric([], float(value))
            return m

        yield gauge("asyncrl_rollout_weight_version", "Current weight version of the rollout service", r.version)
        yield gauge("asyncrl_rollout_paused", "1 while paused for a weight sync", int(r.paused))
        yield gauge("asyncrl_rollouter_idle_ratio", "verl rollouter/idle_ratio of the last completed version",
                    r.idle_ratio if r.idle_ratio is not None else 0.0)
        yield gauge("asyncrl_rollouter_staleness_samples", "verl count/staleness_samples", r.quota.staleness_samples)
        yield gauge("asyncrl_rollouter_max_required_samples", "verl static/max_required_samples", r.quota.max_required_samples)
        yield gauge("asyncrl_rollout_active_trajectories", "Trajectories in flight", r.active)
        yield gauge("asyncrl_rollout_generating", "Generate calls in flight", r.generating)
        yield gauge("asyncrl_rollout_queued_samples", "Finished samples not yet consumed by the trainer", r.queued_samples)
        yield gauge("asyncrl_rollout_outbox_trajectories", "Trajectories waiting in the outbox", r.outbox)
        yield counter("asyncrl_rollout_samples_started", "Samples (prompts) admitted", c.samples_started)
        yield counter("asyncrl_rollout_trajectories_finished", "Trajectories finished", c.trajectories_finished)
        yield counter("asyncrl_rollout_loop_restarts", "Runner loops (admission, publisher) restarted after a bug raised in them",
                      c.loop_restarts)
        yield counter("asyncrl_rollouter_partial_trajectories", "Finished trajectories spanning >1 weight version", c.partial_trajectories)
        yield counter("asyncrl_rollout_tokens_decoded", "Tokens the engines decoded for this service", r.tokens.decoded)
        yield counter("asyncrl_rollout_tokens_kept", "Decoded tokens kept in trajectories", r.tokens.kept)
        outcomes = CounterMetricFamily("asyncrl_rollout_per_request_calls", "Calls per-request pauses kept, resumed, "
                                       "cancelled, or failed to abort (missed: kept under the survivor mode)", labels=["outcome"])
        for outcome in ("kept", "resumed", "cancelled", "missed"):
            outcomes.add_metric([outcome], c.per_request_calls.get(outcome, 0))
        yield outcomes
        yield counter("asyncrl_rollout_reprefill_tokens", "Context tokens of calls per-request pauses resumed (prefilled "
                      "again on the new weights)", c.reprefill_tokens)
        yield gauge("asyncrl_rollout_per_request_pause_seconds", "Seconds the last per-request pause took to decide and "
                    "abort", c.last_per_request_pause_s)
        yield counter("asyncrl_rollout_stale_cancelled_tokens", "Response tokens of trajectories cancelled for staleness "
                      "(decoded, never trained)", c.stale_cancelled_tokens)
        yield gauge("asyncrl_rollout_stale_token_share", "Share of decoded tokens that went to trajectories cancelled for "
                    "staleness", c.stale_cancelled_tokens / r.tokens.decoded if r.tokens.decoded else 0.0)
        yield counter("asyncrl_rollout_cancelled_samples", "Samples whose every trajectory was cancelled for staleness",
                      c.cancelled_samples)
        yield counter("asyncrl_rollout_quota_credited_samples", "Samples credited to the staleness quota for a trainer that "
                      "starved (it dropped samples as too stale)", c.quota_credits)
        pub = r.publisher
        yield counter("asyncrl_rollout_published", "Trajectories stored by JetStream", pub.published)
        yield counter("asyncrl_rollout_publish_duplicates", "Republishes JetStream deduplicated", pub.duplicates)
        yield counter("asyncrl_rollout_publish_retries", "Failed publish attempts (retried)", pub.retries)
        yield counter("asyncrl_rollout_publish_rejected", "Trajectories refused for good (kept in outbox/rejected)", pub.rejected)
        for collector in src.collectors:
            yield from collector.collect()
        reasons = CounterMetricFamily("asyncrl_rollout_finish_reasons", "Finished trajectories by finish reason", labels=["reason"])
        for reason, n in sorted(c.finish_reasons.items()):
            reasons.add_metric([reason], n)
        yield reasons
        failures = CounterMetricFamily("asyncrl_rollout_infra_failures",
                                       "Trajectories spoiled by an infrastructure failure (never trained), by reason",
                                       labels=["reason"])
        for reason, n in sorted(c.failures.items()):
            failures.add_metric([reason], n)
        yield failures
        stats = src.tool_stats()
        calls = CounterMetricFamily("asyncrl_rollout_tool_calls", "Tool calls by tool", labels=["tool"])
        errors = CounterMetricFamily("asyncrl_rollout_tool_errors", "Tool calls that returned an error", labels=["tool"])
        secs = CounterMetricFamily("asyncrl_rollout_tool_seconds", "Time spent in tool calls", labels=["tool"])
        for tool in sorted(stats.calls):
            calls.add_metric([tool], stats.calls[tool])
            errors.add_metric([tool], stats.errors.get(tool, 0))
            secs.add_metric([tool], stats.seconds.get(tool, 0.0))
        yield calls
        yield errors
        yield secs
        handles = list(src.engines())
        eng = GaugeMetricFamily("asyncrl_rollout_engine_inflight", "Requests in flight per engine", labels=["engine", "state"])
        for h in handles:
            eng.add_metric([h.id, h.state], h.inflight)
        yield eng
        by_state = GaugeMetricFamily("asyncrl_rollout_engines", "Engines by state", labels=["state"])
        for state in ENGINE_STATES:
            by_state.add_metric([state], sum(1 for h in handles if h.state == state))
        yield by_state
        wasted = CounterMetricFamily("asyncrl_rollout_engine_quarantined_current_seconds",
                                     "Seconds an engine spent quarantined while holding the current weight version",
                                     labels=["engine"])
        for h in handles:
            wasted.add_metric([h.id], h.quarantined_current_s)
        yield wasted
        msgs = GaugeMetricFamily("asyncrl_nats_store_messages", "Messages in the run's NATS stream and KV buckets", labels=["store"])
        size = GaugeMetricFamily("asyncrl_nats_store_bytes", "Bytes in the run's NATS stream and KV buckets", labels=["store"])
        for name, st in sorted(src.store_sizes().items()):
            msgs.add_metric([name], st["messages"])
            size.add_metric([name], st["bytes"])
        yield msgs
        yield size
        health = src.health(r)
        state = GaugeMetricFamily("asyncrl_rollout_health", "1 for the health block's current state (run_health.py)",
                                  labels=["state"])
        for name in HEALTH_STATES:
            state.add_metric([name], int(health["state"] == name))
        yield state
        yield gauge("asyncrl_rollout_idle_seconds", "Seconds since a token was last decoded",
                    health["idle_s"]["tokens_decoded"] or 0.0)
        st = src.environment()
        if st is not None:
            yield counter("asyncrl_rollout_env_driver_restarts", "Restarts of the verifiers driver after it crashed", st["restarts"])
            yield gauge("asyncrl_rollout_env_groups_started", "Groups the verifiers driver started", st.get("groups_started", 0))
            yield counter("asyncrl_rollout_env_episodes_failed", "Verifiers episodes finished as failures (never trained)",
                          st.get("episodes_failed", 0))


def build_registry(sources: MetricsSources) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(RolloutCollector(sources))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
