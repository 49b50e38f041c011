"""asyncrl.weight_sync: byte-bucket planning, packing, and a real gloo group in two threads."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from asyncrl.launch import free_port
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.weight_sync import (
    host_group,
    host_group_async,
    is_loopback,
    join_group,
    pack_bucket,
    parse_dtype,
    plan_buckets,
    reserve_listen_socket,
    unpack_bucket,
)

GROUP_TIMEOUT_S = 20.0


def test_plan_buckets_keeps_order_mixes_dtypes_and_keeps_alignment():
    named = {
        "a": torch.zeros(10, dtype=torch.float32),  # 40 B
        "b": torch.zeros(10, dtype=torch.float32),
        "c": torch.zeros(30, dtype=torch.float32),  # 120 B: alone (over the limit)
        "d": torch.zeros(3, dtype=torch.bfloat16),  # 6 B: the next float32 would start at an unaligned offset
        "e": torch.zeros(2, 3, dtype=torch.float32),
        "s": torch.zeros((), dtype=torch.float32),
    }
    buckets = plan_buckets(named, bucket_bytes=100)
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["d"], ["e", "s"]]
    assert [n for b in buckets for n in b.names] == list(named)
    assert buckets[2].spec().model_dump() == {"names": ["d"], "dtypes": ["bfloat16"], "shapes": [[3]]}
    assert buckets[3].spec().shapes == [[2, 3], []]
    assert buckets[0].nbytes == 80 and buckets[2].nbytes == 6
    mixed = plan_buckets({"x": torch.zeros(4), "y": torch.zeros(2, dtype=torch.bfloat16), "z": torch.zeros(1)}, 1000)
    assert [b.names for b in mixed] == [["x", "y", "z"]] and mixed[0].spec().dtypes == ["float32", "bfloat16", "float32"]
    tiny_first = plan_buckets(named, bucket_bytes=100, first_tiny=True)
    assert tiny_first[0].names == ["s"] and sorted(n for b in tiny_first for n in b.names) == sorted(named)
    with pytest.raises(ValueError):
        plan_buckets(named, 0)


def test_pack_roundtrip_mixed_dtypes_and_errors():
    ts = [torch.randn(2, 3), torch.randn(4).to(torch.bfloat16), torch.randn(())]
    flat = pack_bucket(ts)
    assert flat.dtype == torch.uint8 and flat.numel() == 24 + 8 + 4
    back = unpack_bucket(flat, ["a", "b", "c"], ["float32", "bfloat16", "float32"], [[2, 3], [4], []])
    assert all(torch.equal(a, b) for a, b in zip(ts, back, strict=True))
    with pytest.raises(ValueError, match="Unaligned received tensor b"):
        unpack_bucket(torch.zeros(10, dtype=torch.uint8), ["a", "b"], ["bfloat16", "float32"], [[1], [2]])
    with pytest.raises(ValueError):
        unpack_bucket(flat, ["a"], ["float32"], [[2, 3]])
    with pytest.raises(ValueError):
        pack_bucket(ts, out=torch.empty(3, dtype=torch.uint8))
    assert parse_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError):
        parse_dtype("complex-ish")


def test_loopback_detection_and_binding():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("10.1.2.3") and not is_loopback("engine-0.svc")
    sock = reserve_listen_socket("127.0.0.1")
    try:
        assert sock.getsockname()[0] == "127.0.0.1" and sock.getsockname()[1] > 0
    finally:
        sock.close()


def _receiver(port: int, out: dict) -> None:
    try:
        group = join_group("127.0.0.1", port, 2, 1, timeout_s=GROUP_TIMEOUT_S)
        flat = torch.empty(24 + 8, dtype=torch.uint8)
        group.broadcast(flat)
        out["flat"] = unpack_bucket(flat, ["a", "b"], ["float32", "bfloat16"], [[2, 3], [4]])
        group.destroy()
    except Exception as exc:  # reported to the main thread
        out["error"] = exc


def test_group_broadcasts_buckets_between_two_ranks():
    sock = reserve_listen_socket("127.0.0.1")
    port = sock.getsockname()[1]
    out: dict = {}
    t = threading.Thread(target=_receiver, args=(port, out), daemon=True)
    t.start()
    group = host_group("127.0.0.1", port, 2, timeout_s=GROUP_TIMEOUT_S, listen_socket=sock)
    try:
        sent = [torch.randn(2, 3), torch.randn(4).to(torch.bfloat16)]
        group.broadcast(pack_bucket(sent))
        t.join(GROUP_TIMEOUT_S)
        assert "error" not in out, out.get("error")
        assert all(torch.equal(a, b) for a, b in zip(sent, out["flat"], strict=True))
        # the peer has left: the next broadcast fails fast and marks the group broken
        with pytest.raises(WeightSyncError):
            group.broadcast(pack_bucket(sent), timeout_s=5)
        assert group.broken
        with pytest.raises(WeightSyncError, match="broken"):
            group.broadcast(pack_bucket(sent))
    finally:
        group.destroy()


def test_a_cancelled_broadcast_stops_at_once_and_breaks_the_group():
    """The sender stops waiting as soon as the cancel event is set (an engine refused the
    bucket and will never receive), instead of sitting in the collective until its timeout."""
    sock = reserve_listen_socket("127.0.0.1")
    port = sock.getsockname()[1]
    joined: dict = {}
    t = threading.Thread(target=lambda: joined.update(g=join_group("127.0.0.1", port, 2, 1, timeout_s=GROUP_TIMEOUT_S)), daemon=True)
    t.start()
    group = host_group("127.0.0.1", port, 2, timeout_s=GROUP_TIMEOUT_S, listen_socket=sock)
    t.join(GROUP_TIMEOUT_S)
    cancel = threading.Event()
    timer = threading.Timer(0.5, cancel.set)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match="cancelled"):
            group.broadcast(torch.ones(64 * 2**20, dtype=torch.uint8), timeout_s=120, cancel=cancel)  # the peer never receives
        assert time.monotonic() - started < 30 and group.broken == "cancelled"
    finally:
        timer.cancel()
        group.destroy()
        joined["g"].destroy()


def test_hosting_from_a_coroutine_forms_the_group_and_an_abandoned_one_holds_nothing_up():
    """host_group_async forms the group like host_group; when the task awaiting it is given up
    (a sync the agent abandoned), the loop and the process do not wait out the rendezvous's
    timeout: asyncio.run returns at once (asyncio.to_thread would hold it for timeout_s)."""

    async def formed() -> None:
        sock = reserve_listen_socket("127.0.0.1")
        port = sock.getsockname()[1]
        joined: dict = {}
        t = threading.Thread(target=lambda: joined.update(g=join_group("127.0.0.1", port, 2, 1, timeout_s=GROUP_TIMEOUT_S)),
                             daemon=True)
        t.start()
        group = await asyncio.wait_for(host_group_async("127.0.0.1", port, 2, timeout_s=GROUP_TIMEOUT_S, listen_socket=sock),
                                       GROUP_TIMEOUT_S + 10)
        t.join(GROUP_TIMEOUT_S)
        try:
            assert group.world_size == 2 and not group.broken and "g" in joined
        finally:
            group.destroy()
            joined["g"].destroy()

    asyncio.run(formed())

    abandoned_timeout_s = 60.0

    async def abandoned() -> None:
        sock = reserve_listen_socket("127.0.0.1")
        task = asyncio.create_task(host_group_async("127.0.0.1", sock.getsockname()[1], 2, timeout_s=abandoned_timeout_s,
                                                    listen_socket=sock))
        await asyncio.sleep(0.5)  # nobody joins; the run ends with the task pending (cancelled by asyncio.run)
        assert not task.done()

    started = time.monotonic()
    asyncio.run(abandoned())
    assert time.monotonic() - started < abandoned_timeout_s / 4, "the loop's shutdown waited for the abandoned rendezvous"


def test_joining_a_group_nobody_hosts_times_out():
    port = free_port()  # below the ephemeral range: the joins' own connections cannot land on it
    started = time.monotonic()
    with pytest.raises(WeightSyncError):
        join_group("127.0.0.1", port, 2, 1, timeout_s=2)
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_engine_finite_check_catches_nan_and_both_infinities_anywhere(dtype):
    """The engine's one-pass finite check (min/max) against isfinite, value by value."""
    from local_engine.weights import _finite

    assert _finite(torch.empty(0, dtype=dtype))
    base = torch.linspace(-3, 3, 257, dtype=dtype)
    assert _finite(base)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 128, 256):
            t = base.clone()
            t[where] = bad
            assert not _finite(t), (bad, where)
            assert not _finite(t.view(1, 257)), (bad, where)
