"""Metric names of the third-party exporters compose.yaml runs, which cannot run here.

Each list is copied from the exporter's source at a pinned version (the one compose.yaml
uses); tests/deploy/test_stack.py adds the names that *can* be observed for real
(asyncrl's own services, and ``gnatsd_varz_*``, derived from a real nats-server's /varz the
way the exporter derives them).
"""

from __future__ import annotations

# lmsysorg/sglang:v0.5.18 (python/sglang/srt/metrics/collector.py) and v0.5.23
# (python/sglang/srt/observability/metrics_collector.py), --enable-metrics:
# SchedulerMetricsCollector gauges and TokenizerMetricsCollector counters/histograms used by
# the dashboard. Histograms expose _bucket/_sum/_count, counters _total.
SGLANG_GAUGES = {
    "sglang:num_running_reqs", "sglang:num_used_tokens", "sglang:token_usage", "sglang:gen_throughput",
    "sglang:num_queue_reqs", "sglang:cache_hit_rate", "sglang:max_total_num_tokens",
}
SGLANG_COUNTERS = {
    "sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:cached_tokens_total",
    "sglang:num_requests_total", "sglang:num_aborted_requests_total",
}
SGLANG_HISTOGRAMS = {
    "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds", "sglang:e2e_request_latency_seconds",
}

# natsio/prometheus-nats-exporter:0.20.1 with -jsz=all: collector/jsz.go, names built as
# jetstream_<subsystem>_<name> (BuildFQName(system="jetstream", ...)).
NATS_JSZ = {
    "jetstream_server_jetstream_disabled", "jetstream_server_total_streams", "jetstream_server_total_consumers",
    "jetstream_server_total_messages", "jetstream_server_total_message_bytes", "jetstream_server_max_memory",
    "jetstream_server_max_storage", "jetstream_account_max_memory", "jetstream_account_max_storage",
    "jetstream_account_storage_used", "jetstream_account_memory_used", "jetstream_stream_total_messages",
    "jetstream_stream_limit_messages", "jetstream_stream_total_bytes", "jetstream_stream_limit_bytes",
    "jetstream_stream_first_seq", "jetstream_stream_last_seq", "jetstream_stream_consumer_count",
    "jetstream_stream_subject_count", "jetstream_consumer_delivered_consumer_seq",
    "jetstream_consumer_delivered_stream_seq", "jetstream_consumer_last_delivery_seconds",
    "jetstream_consumer_last_ack_seconds", "jetstream_consumer_num_ack_pending", "jetstream_consumer_num_redelivered",
    "jetstream_consumer_num_waiting", "jetstream_consumer_num_pending", "jetstream_consumer_ack_floor_stream_seq",
    "jetstream_consumer_ack_floor_consumer_seq",
}


def sglang_series() -> set[str]:
    out = set(SGLANG_GAUGES) | set(SGLANG_COUNTERS)
    for h in SGLANG_HISTOGRAMS:
        out |= {f"{h}_bucket", f"{h}_sum", f"{h}_count"}
    return out


def varz_series(varz: dict, prefix: str = "gnatsd_varz") -> set[str]:
    """prometheus-nats-exporter's -varz names for a /varz document (collector.go
    ``objectToMetrics``: every number, nested objects flattened with ``_``)."""
    out: set[str] = set()

    def walk(obj: dict, path: list[str]) -> None:
        for key, value in obj.items():
            if isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                fqn = "_".join([*path, key]).replace("/", "_").strip("_")
                while "__" in fqn:
                    fqn = fqn.replace("__", "_")
                out.add(f"{prefix}_{fqn}")
            elif isinstance(value, dict):
                walk(value, [*path, key])

    walk(varz, [])
    return out
