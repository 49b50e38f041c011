"""asyncrl.weight_sync: bucket planning, (un)flattening, and a real gloo group in two threads."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from asyncrl.weight_sync import (
    WeightSyncError,
    broadcast_bucket,
    flatten_bucket,
    init_weight_group,
    is_loopback,
    parse_dtype,
    plan_buckets,
    receive_bucket,
    reserve_listen_socket,
    unflatten_bucket,
)

GROUP_TIMEOUT_S = 20.0


def test_plan_buckets_keeps_order_and_dtype_and_size():
    named = {
        "a": torch.zeros(10, dtype=torch.float32),  # 40 B
        "b": torch.zeros(10, dtype=torch.float32),
        "c": torch.zeros(30, dtype=torch.float32),  # 120 B: alone (over the limit)
        "d": torch.zeros(4, dtype=torch.bfloat16),
        "e": torch.zeros(2, 3, dtype=torch.float32),
        "s": torch.zeros((), dtype=torch.float32),
    }
    buckets = plan_buckets(named, bucket_bytes=100)
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["d"], ["e", "s"]]
    assert [n for b in buckets for n in b.names] == list(named)
    assert buckets[2].http_fields() == {"names": ["d"], "dtypes": ["bfloat16"], "shapes": [[4]]}
    assert buckets[3].http_fields()["shapes"] == [[2, 3], []]
    assert buckets[0].nbytes == 80 and buckets[1].numel == 30
    with pytest.raises(ValueError):
        plan_buckets(named, 0)


def test_flatten_roundtrip_and_errors():
    ts = [torch.randn(2, 3), torch.randn(4), torch.randn(())]
    flat = flatten_bucket(ts)
    assert flat.shape == (11,)
    back = unflatten_bucket(flat, [t.shape for t in ts])
    assert all(torch.equal(a, b) for a, b in zip(ts, back, strict=True))
    with pytest.raises(ValueError):
        flatten_bucket([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])
    with pytest.raises(ValueError):
        unflatten_bucket(flat, [[2, 3]])
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
        group = init_weight_group("127.0.0.1", port, 2, 1, timeout_s=GROUP_TIMEOUT_S)
        out["flat"] = receive_bucket(group, [torch.float32] * 2, [[2, 3], [4]], flattened=True)
        out["each"] = receive_bucket(group, [torch.bfloat16], [[5]], flattened=False)
        group.destroy()
    except Exception as exc:  # reported to the main thread
        out["error"] = exc


def test_group_broadcasts_buckets_between_two_ranks():
    sock = reserve_listen_socket("127.0.0.1")
    port = sock.getsockname()[1]
    out: dict = {}
    t = threading.Thread(target=_receiver, args=(port, out), daemon=True)
    t.start()
    group = init_weight_group("127.0.0.1", port, 2, 0, timeout_s=GROUP_TIMEOUT_S, listen_socket=sock)
    try:
        sent = [torch.randn(2, 3), torch.randn(4)]
        broadcast_bucket(group, sent, flattened=True)
        other = torch.randn(5).to(torch.bfloat16)
        broadcast_bucket(group, [other], flattened=False)
        t.join(GROUP_TIMEOUT_S)
        assert "error" not in out, out.get("error")
        assert all(torch.equal(a, b) for a, b in zip(sent, out["flat"], strict=True))
        assert torch.equal(out["each"][0], other)
        # the peer has left: the next broadcast fails fast and marks the group broken
        with pytest.raises(WeightSyncError):
            broadcast_bucket(group, sent, flattened=True, timeout_s=5)
        assert group.broken
        with pytest.raises(WeightSyncError, match="broken"):
            broadcast_bucket(group, sent)
    finally:
        group.destroy()


def test_joining_a_group_nobody_hosts_times_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(WeightSyncError):
        init_weight_group("127.0.0.1", port, 2, 1, timeout_s=2)
    assert time.monotonic() - started < 15
