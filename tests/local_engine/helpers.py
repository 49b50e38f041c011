"""Reading an engine's running load, for the local_engine tests' waits."""

from __future__ import annotations


async def running_tokens(client) -> int:
    """Prompt + output tokens of the running requests (from /v1/loads)."""
    return (await client.loads())["loads"][0]["num_total_tokens"]


async def load(client) -> dict:
    return (await client.loads())["loads"][0]
