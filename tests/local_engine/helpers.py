"""Small bounded-wait helpers shared by the local_engine tests."""

from __future__ import annotations

import asyncio
import time

WAIT_S = 30.0  # every condition a test waits for must hold within this (busy 2-core box)


async def wait_until(predicate, what: str, timeout_s: float = WAIT_S, interval_s: float = 0.02):
    """Await ``predicate()`` (sync or async) until truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


async def running_tokens(client) -> int:
    """Prompt + output tokens of the running requests (from /v1/loads)."""
    return (await client.loads())["loads"][0]["num_total_tokens"]


async def load(client) -> dict:
    return (await client.loads())["loads"][0]
