"""Reading an engine's running load, for the local_engine tests' waits."""

from __future__ import annotations

import aiohttp


async def running_tokens(client) -> int:
    """Prompt + output tokens of the running requests (from /v1/loads)."""
    return (await client.loads())["loads"][0]["num_total_tokens"]


async def load(client) -> dict:
    return (await client.loads())["loads"][0]


async def paused_gauge(url: str) -> float:
    """``local_engine_paused`` from the engine's /metrics: 1 from the moment a pause arrives."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("local_engine_paused "))
