"""The event-loop lag monitor sees a blocking call on the loop."""

from __future__ import annotations

import asyncio
import time

from rollout_service.loop_lag import LoopLag
from tests.helpers.waiting import wait_for


def buckets(lag: LoopLag) -> dict[str, float]:
    return {s.labels["le"]: s.value for fam in lag.collect() for s in fam.samples if s.name.endswith("_bucket")}


async def test_a_blocking_call_on_the_loop_shows_as_lag():
    lag = LoopLag(interval_s=0.01)
    stop = asyncio.Event()
    task = asyncio.create_task(lag.run(stop))
    await wait_for(lambda: buckets(lag)["+Inf"] >= 3, 10, "a few lag samples")
    above = buckets(lag)["+Inf"] - buckets(lag)["0.2"]
    time.sleep(0.5)  # a blocking call on the event loop (e.g. an fsync): the pending sleep wakes >= 0.49 s late
    await wait_for(lambda: buckets(lag)["+Inf"] - buckets(lag)["0.2"] >= above + 1, 10, "the stall recorded")
    stop.set()
    await task
