"""Prometheus metrics of one engine, in its own ``CollectorRegistry`` (no global state).

Names follow SGLang where it has one (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``) so dashboards work for
both; local_engine extras use the ``local_engine_`` prefix.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineMetrics:
    """Holds the collectors; :meth:`render` gives the text exposition."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.running = Gauge("sglang:num_running_reqs", "Requests in the running batch", registry=r)
        self.waiting = Gauge("sglang:num_queue_reqs", "Requests waiting to be prefilled", registry=r)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("local_engine_requests_finished", "Finished requests by finish_reason type", ["reason"], registry=r)
        self.decode_batch = Histogram("local_engine_decode_batch_size", "Rows per decode step", buckets=BATCH_BUCKETS, registry=r)
        self.max_decode_batch = Gauge("local_engine_max_decode_batch_size", "Largest decode batch since start", registry=r)
        self.weight_version = Gauge("local_engine_weight_version", "Weight version (NaN if not numeric)", registry=r)
        self.weight_version_info = Gauge("local_engine_weight_version_info", "Weight version as a label", ["version"], registry=r)
        self.weight_updates = Counter("local_engine_weight_updates", "Weight update calls by result", ["kind", "result"], registry=r)
        self.paused = Gauge("local_engine_paused", "1 while generation is paused", registry=r)
        self.gate_waiting = Gauge("local_engine_gate_waiting", "/generate calls held at the pause gate", registry=r)
        self.aborts_dropped = Counter("local_engine_aborts_dropped", "Exact-rid aborts dropped: the request's one abort "
                                      "was already passed on (SGLang 0.5.20+)", registry=r)
        self.recomputed_tokens = Gauge("local_engine_recomputed_prefill_tokens",
                                       "Timing mode: running total of context tokens prefilled again after an "
                                       "abort or retract (0 in model mode, which cannot tell)", registry=r)

    def set_version(self, version: str) -> None:
        try:
            value = float(version)
        except ValueError:
            value = math.nan
        self.weight_version.set(value)
        self.weight_version_info.clear()
        self.weight_version_info.labels(version=version).set(1)

    def on_step(self, kind: str, rows: int, tokens: int) -> None:
        if kind == "prefill":
            self.prompt_tokens.inc(tokens)
            self.generation_tokens.inc(rows)
        else:
            self.generation_tokens.inc(tokens)
            self.decode_batch.observe(rows)
            if rows > self.max_decode_batch._value.get():
                self.max_decode_batch.set(rows)

    def render(self) -> bytes:
        return generate_latest(self.registry)
