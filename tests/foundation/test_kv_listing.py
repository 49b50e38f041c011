"""kv_entries lists a KV bucket whole from the server's count (asyncrl/jetstream/kv_listing.py),
against a real nats-server: live keys with their latest values, no deleted or forgotten key,
an empty bucket, many keys, and a bucket listed while the client is too busy to read."""

from __future__ import annotations

import asyncio
import time

from asyncrl.jetstream import connect, ensure_kv, kv_entries, kv_forget


async def test_lists_the_live_keys_with_their_latest_values(nats_server):
    nc = await connect(nats_server.url, "test", persistent=False)
    try:
        js = nc.jetstream()
        kv = await ensure_kv(js, "listing")
        assert await kv_entries(js, "listing") == []
        for i in range(5):
            await kv.put(f"k{i}", f"v{i}".encode())
        await kv.put("k1", b"newer")
        await kv.delete("k2")  # a delete marker stays: not a live key
        await kv_forget(js, "listing", "k3")  # a purge marker with a TTL: not a live key either
        await kv.put("empty", b"")
        assert await kv_entries(js, "listing") == [("k0", b"v0"), ("k1", b"newer"), ("k4", b"v4")]
    finally:
        await nc.close()


async def test_every_key_of_a_large_bucket_is_listed_while_the_loop_is_busy(nats_server):
    """The listing's end comes from the server's count, not from when the client reads deliveries:
    a loop kept busy (blocking slices, as a loaded service's is) still gets every key."""
    nc = await connect(nats_server.url, "test", persistent=False)
    try:
        js = nc.jetstream()
        kv = await ensure_kv(js, "many")
        want = {f"agent-{i:04d}": bytes([i % 251]) * (1 + i % 300) for i in range(600)}
        await asyncio.gather(*(kv.put(k, v) for k, v in want.items()))
        stop = asyncio.Event()

        async def busy() -> None:
            while not stop.is_set():
                time.sleep(0.003)  # noqa: ASYNC251 - the point: the event loop is held
                await asyncio.sleep(0)

        hog = asyncio.create_task(busy())
        try:
            assert dict(await kv_entries(js, "many")) == want
        finally:
            stop.set()
            await hog
    finally:
        await nc.close()
