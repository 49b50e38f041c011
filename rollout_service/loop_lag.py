"""How late the rollout service's event loop runs: the sign that the service is the bottleneck.

Everything the service does (agents, HTTP to engines and clients, NATS, the publisher) shares
one event loop; when its callbacks take more time than there is, every timer and every
ready socket waits. ``LoopLag.run`` sleeps ``interval_s`` again and again and records how much
later than asked it woke (``asyncrl_rollout_event_loop_lag_seconds``, a histogram): near 0 on
a service with headroom; tens of ms or more when the loop is saturated, whether by CPU work
or by a blocking call on the loop (the CPU share alone misses the latter). Measures the lag
only at its own wake-ups (sampling every ``interval_s``; a single long stall is seen once).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Histogram

LAG_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
INTERVAL_S = 0.1


class LoopLag:
    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.histogram = Histogram("asyncrl_rollout_event_loop_lag_seconds",
                                   "How much later than scheduled the service's event loop ran a timer",
                                   buckets=LAG_BUCKETS_S, registry=None)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            before = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.histogram.observe(max(0.0, time.monotonic() - before - self.interval_s))

    def collect(self):
        yield from self.histogram.collect()
