"""Timing mode: no model compute, per-step latency and long-tailed lengths, real protocol."""

from __future__ import annotations

import asyncio
import statistics
import time

from asyncrl.engine_client import EngineClient
from tests.helpers.processes import start_engine


async def test_timing_mode_lengths_latency_and_batching(tmp_path):
    with start_engine(tmp_path, "--timing-mode", "--timing-decode-ms", "10", "--timing-length-median", "40",
                      "--timing-length-sigma", "0.8", "--timing-length-max", "300") as engine:
        async with EngineClient(engine.url) as c:
            t0 = time.monotonic()
            one = await c.generate([1, 2, 3], {"max_new_tokens": 1000})
            single = time.monotonic() - t0
            assert one.finish_reason.type == "stop" and 1 <= len(one.output_ids) <= 300
            assert single >= len(one.output_ids) * 0.010 * 0.9, "each decode step takes its latency"
            t0 = time.monotonic()
            many = await asyncio.gather(*(c.generate([1, 2, 3], {"max_new_tokens": 1000}) for _ in range(24)))
            batched = time.monotonic() - t0
            lengths = [len(r.output_ids) for r in many]
            assert max(lengths) <= 300 and len(set(lengths)) > 5, "lengths are drawn, not fixed"
            assert max(lengths) > 2 * statistics.median(lengths), "a long tail"
            # batched decoding: 24 rows take about as long as the longest one, not the sum
            assert batched < sum(lengths) * 0.010 * 0.5
            info = await c.model_info()
            assert info["weight_version"] == "default"
