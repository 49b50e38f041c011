"""Prometheus metrics of the sync agent, read from its records at scrape time.

``asyncrl_sync_weight_version``, ``asyncrl_sync_syncs_total{state}``,
``asyncrl_sync_phase_seconds{phase}`` (of the last finished sync),
``asyncrl_sync_bytes_total``, ``asyncrl_sync_last_gb_per_s``, ``asyncrl_sync_failures_total``,
``asyncrl_sync_refused_total{reason}`` (counters since the agent started, from its tally),
``asyncrl_sync_consecutive_failures``, ``asyncrl_sync_seconds_since_success``,
``asyncrl_sync_engines_needing_reload``, ``asyncrl_sync_engine_weight_version{engine,url,state}``
(from the agent's last look at the engines, every ``sync.reconcile_interval_s``).
"""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class SyncCollector:
    def __init__(self, agent) -> None:
        self.agent = agent

    def collect(self):
        co = self.agent.coordinator
        recs = co.records
        g = GaugeMetricFamily("asyncrl_sync_weight_version", "Weight version the engines were last synced to")
        g.add_metric([], co.version)
        yield g
        tally = co.tally
        states = CounterMetricFamily("asyncrl_sync_syncs", "Syncs by final state (since the agent started)", labels=["state"])
        states.add_metric(["succeeded"], tally.succeeded)
        states.add_metric(["failed"], tally.failed)
        yield states
        fails = CounterMetricFamily("asyncrl_sync_failures", "Failed syncs (since the agent started)")
        fails.add_metric([], tally.failed)
        yield fails
        refused = CounterMetricFamily("asyncrl_sync_refused", "Sync requests refused, by reason (stale, no_engines, ...)",
                                      labels=["reason"])
        for code, n in sorted(tally.refused.items()):
            refused.add_metric([code], n)
        yield refused
        total = CounterMetricFamily("asyncrl_sync_bytes", "Bytes of weights moved by finished syncs (since the agent started)")
        total.add_metric([], tally.bytes_moved)
        yield total
        last = next((r for r in reversed(recs) if r.done), None)
        phases = GaugeMetricFamily("asyncrl_sync_phase_seconds", "Phase durations of the last finished sync", labels=["phase"])
        speed = GaugeMetricFamily("asyncrl_sync_last_gb_per_s", "Achieved GB/s of the last finished sync's loading phase")
        if last is not None:
            for phase, secs in last.phase_seconds.items():
                phases.add_metric([phase], secs)
            speed.add_metric([], last.gb_per_s or 0.0)
        yield phases
        yield speed
        engines = GaugeMetricFamily("asyncrl_sync_engine_weight_version", "Weight version each engine reports (last check)",
                                    labels=["engine", "url", "state"])
        for v in co.fleet.last_views:
            if v.version is not None:
                engines.add_metric([v.id, v.url, v.rollout_state], v.version)
        yield engines
        reload = GaugeMetricFamily("asyncrl_sync_engines_needing_reload", "Engines waiting for a reload after a failed update")
        reload.add_metric([], len(co.needs_reload))
        yield reload
        row = GaugeMetricFamily("asyncrl_sync_consecutive_failures", "Syncs failed in a row (0 after a success)")
        row.add_metric([], tally.consecutive_failures)
        yield row
        since = GaugeMetricFamily("asyncrl_sync_seconds_since_success", "Seconds since a sync last succeeded (since start if none)")
        since.add_metric([], time.time() - (tally.last_success_at or self.agent.started_at))
        yield since
