"""The embedded nats-server and the run's stream, against a real server process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError

from asyncrl.config import load_config
from asyncrl.jetstream import (
    EmbeddedNats,
    StreamMismatch,
    StreamSettings,
    StreamStorageShort,
    connect,
    ensure_kv,
    ensure_stream,
    resolve_nats_url,
    write_endpoint,
)
from asyncrl.launch import port_open
from asyncrl.wire import NatsNames
from tests.helpers.waiting import wait_for_sync


async def test_stream_is_created_with_dedup_and_a_duplicate_is_stored_once(run_config, nats_server):
    nc = await connect(nats_server.url, "test", persistent=False)
    try:
        js = nc.jetstream()
        sc = await ensure_stream(js, StreamSettings.of(run_config))
        assert sc.retention == RetentionPolicy.LIMITS and sc.storage == StorageType.FILE
        assert sc.discard == DiscardPolicy.NEW
        assert sc.duplicate_window == pytest.approx(run_config.nats.duplicate_window_s)
        assert sc.max_msg_size == run_config.derived.max_message_bytes
        subject = NatsNames(run_config.run.id).trajectories
        first = await js.publish(subject, b"a", headers={"Nats-Msg-Id": "traj-1"})
        again = await js.publish(subject, b"a", headers={"Nats-Msg-Id": "traj-1"})
        other = await js.publish(subject, b"b", headers={"Nats-Msg-Id": "traj-2"})
        assert not first.duplicate and again.duplicate and again.seq == first.seq
        info = await js.stream_info(sc.name)
        assert info.state.messages == 2 and other.seq == first.seq + 1
    finally:
        await nc.close()


async def test_dedup_survives_a_server_restart(run_config, nats_server):
    subject = NatsNames(run_config.run.id).trajectories
    nc = await connect(nats_server.url, "test", persistent=False)
    await ensure_stream(nc.jetstream(), StreamSettings.of(run_config))
    await nc.jetstream().publish(subject, b"a", headers={"Nats-Msg-Id": "traj-1"})
    await nc.close()
    nats_server.kill()  # SIGKILL: an acknowledged message must still be there
    nats_server.start()
    nc = await connect(nats_server.url, "test", persistent=False)
    try:
        ack = await nc.jetstream().publish(subject, b"a", headers={"Nats-Msg-Id": "traj-1"})
        assert ack.duplicate
        assert (await nc.jetstream().stream_info(NatsNames(run_config.run.id).stream)).state.messages == 1
    finally:
        await nc.close()


async def test_ensure_stream_is_idempotent_and_reconciles_limits(tmp_path, nats_server):
    base = [f"run.dir={tmp_path}", f"nats.url={nats_server.url}"]
    nc = await connect(nats_server.url, "test", persistent=False)
    try:
        js = nc.jetstream()
        await ensure_stream(js, StreamSettings.of(load_config(overrides=base, environ={})))
        bigger = load_config(overrides=[*base, "model.max_model_len=8192", "nats.duplicate_window_s=600"], environ={})
        sc = await ensure_stream(js, StreamSettings.of(bigger))
        assert sc.max_msg_size == bigger.derived.max_message_bytes and sc.duplicate_window == pytest.approx(600)
        assert len(await js.streams_info()) == 1
    finally:
        await nc.close()


async def test_incompatible_existing_stream_is_refused(run_config, nats_server):
    nc = await connect(nats_server.url, "test", persistent=False)
    try:
        js = nc.jetstream()
        names = NatsNames(run_config.run.id)
        await js.add_stream(StreamConfig(name=names.stream, subjects=names.stream_subjects,
                                         retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
        with pytest.raises(StreamMismatch, match="retention"):
            await ensure_stream(js, StreamSettings.of(run_config))
    finally:
        await nc.close()


async def test_a_stream_the_store_cannot_reserve_is_refused_naming_the_knob(tmp_path):
    """JetStream reserves ``nats.stream_max_bytes`` against the server's store limit: a second
    run's stream that does not fit is refused with the knob named; a smaller one still fits."""
    with EmbeddedNats(tmp_path / "nats", max_store_bytes=48 * 2**20) as server:
        assert '"max_file_store": 50331648' in server.config_path.read_text()
        nc = await connect(server.url, "test", persistent=False)
        try:
            js = nc.jetstream()
            first = load_config(overrides=[f"run.dir={tmp_path}", "run.id=one", f"nats.stream_max_bytes={32 * 2**20}"], environ={})
            await ensure_stream(js, StreamSettings.of(first))
            second = load_config(overrides=[f"run.dir={tmp_path}", "run.id=two", f"nats.stream_max_bytes={32 * 2**20}"], environ={})
            with pytest.raises(StreamStorageShort, match=r"nats\.stream_max_bytes=33554432 .*ASYNCRL_TWO"):
                await ensure_stream(js, StreamSettings.of(second))
            with pytest.raises(StreamStorageShort, match="max_file_store"):  # growing one in place: the same
                await ensure_stream(js, StreamSettings(first.run.id, 64 * 2**20, first.derived.max_message_bytes, 120.0))
            smaller = load_config(overrides=[f"run.dir={tmp_path}", "run.id=two", f"nats.stream_max_bytes={8 * 2**20}"], environ={})
            assert (await ensure_stream(js, StreamSettings.of(smaller))).max_bytes == 8 * 2**20
        finally:
            await nc.close()


async def test_oversized_message_is_rejected_not_truncated(tmp_path, nats_server):
    cfg = load_config(overrides=[f"run.dir={tmp_path}", "model.max_model_len=16"], environ={})
    nc = await connect(nats_server.url, "test", persistent=False)
    try:
        js = nc.jetstream()
        await ensure_stream(js, StreamSettings.of(cfg))
        too_big = b"x" * (cfg.derived.max_message_bytes + 1)
        with pytest.raises(APIError):
            await js.publish(NatsNames(cfg.run.id).trajectories, too_big)
    finally:
        await nc.close()


async def test_kv_bucket_created_once(run_config, nats_server):
    nc = await connect(nats_server.url, "test", persistent=False)
    try:
        js = nc.jetstream()
        bucket = NatsNames(run_config.run.id).agents_bucket
        kv = await ensure_kv(js, bucket)
        await kv.put("a", b"1")
        kv2 = await ensure_kv(js, bucket)
        assert (await kv2.get("a")).value == b"1"
    finally:
        await nc.close()


def test_server_binds_loopback_only_and_stops(tmp_path: Path):
    server = EmbeddedNats(tmp_path)
    server.start()
    assert port_open("127.0.0.1", server.port)
    assert '"host": "127.0.0.1"' in server.config_path.read_text()
    server.stop()
    assert not port_open("127.0.0.1", server.port)


def test_endpoint_resolution(tmp_path: Path):
    with pytest.raises(LookupError, match="asyncrl nats"):
        resolve_nats_url(None, tmp_path)
    assert resolve_nats_url("nats://x:1", tmp_path) == "nats://x:1"
    with EmbeddedNats(tmp_path) as server:
        write_endpoint(server)
        assert resolve_nats_url(None, tmp_path) == server.url
    with pytest.raises(LookupError):  # a stale endpoint file of a stopped server is not used
        resolve_nats_url(None, tmp_path)


def test_max_payload_bound_is_checked(tmp_path: Path):
    with pytest.raises(ValueError, match="max_model_len"):
        EmbeddedNats(tmp_path, max_payload=65 * 2**20)


def test_nats_cli_runs_and_stops_cleanly(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "nats", f"run.dir={tmp_path}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        endpoint = tmp_path / "nats" / "endpoint"
        wait_for_sync(endpoint.exists, 30, "asyncrl nats to write its endpoint", procs=[proc], interval_s=0.05)
        url = endpoint.read_text().strip()
        host, port = url.removeprefix("nats://").split(":")
        assert host == "127.0.0.1" and port_open(host, int(port))
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "ASYNCRL_DEMO" in out and not port_open(host, int(port))
    finally:
        if proc.poll() is None:
            proc.kill()
