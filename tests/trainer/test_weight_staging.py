"""The sync's device path (``sync.staging=buckets``, trainer_daemon/sync/staging.py): the
buckets packed at the sync point hold exactly the version's weights in the engines' dtype and
layout, on one rank and gathered from two FSDP2 ranks (gloo: the same code as NCCL's), stay
that version while training changes the parameters, reuse their buffers, and are replaced after
a failed publish. The publishers send them as they are (plan_for, send_buckets).

``two_buckets`` (trainer_daemon/sync/streaming.py): the same weights through two alternating
buffers, the producer never more than one bucket ahead of the wire, the version kept while
training goes on, a failed or absent publish never leaving the training thread waiting longer
than the stream's bound, new buffers after a failure; ``auto``'s choice between the modes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncrl.launch import free_port
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.weight_sync import unpack_bucket
from trainer_daemon.io_loop import IoLoop
from trainer_daemon.policy.model import build_policy, engine_weights, full_state_dict
from trainer_daemon.sync.base import SyncController, WeightPublisher
from trainer_daemon.sync.flat import FlatBuffers, plan_for, send_buckets, weights_nbytes
from trainer_daemon.sync.staging import StagedWeights, WeightStager

WORKER = str(Path(__file__).with_name("step_worker.py"))
ROOT = str(Path(__file__).resolve().parents[2])


def unpacked(staged: StagedWeights) -> dict[str, torch.Tensor]:
    out = {}
    for bucket, flat in zip(staged.buckets, staged.flats, strict=True):
        spec = bucket.spec()
        out.update(zip(spec.names, (t.clone() for t in unpack_bucket(flat, spec.names, spec.dtypes, spec.shapes)), strict=True))
    return out


@pytest.fixture
def policy():
    torch.manual_seed(0)
    return build_policy("builtin:tiny", 0, torch.device("cpu"), 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_staged_buckets_are_the_engine_weights_bit_for_bit(policy, dtype):
    tied = bool(policy.config.tie_word_embeddings)
    stager = WeightStager(policy, tied=tied, dtype=dtype, bucket_bytes=2**16, device="cpu", is_sender=True)
    staged = stager.capture(policy)
    expected = engine_weights(full_state_dict(policy), tied, dtype)
    got = unpacked(staged)
    assert list(got) != list(expected)  # the smallest tensor goes first, alone
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert len(staged.buckets[0].names) == 1 and len(staged.buckets) > 2
    assert staged.nbytes == weights_nbytes(expected) == stager.nbytes
    assert staged.timings["timing_s/sync_stage"] >= staged.timings["timing_s/sync_stage_gather"] >= 0


def test_a_staged_version_stays_while_training_changes_the_weights(policy):
    stager = WeightStager(policy, tied=True, dtype=torch.bfloat16, bucket_bytes=2**16, device="cpu", is_sender=True)
    first = stager.capture(policy)
    before = unpacked(first)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    assert all(torch.equal(t, before[n]) for n, t in unpacked(first).items())  # a snapshot, not a view
    assert stager.capture(policy, write=False) is None  # rank 0 skipping: buffers untouched
    assert all(torch.equal(t, before[n]) for n, t in unpacked(first).items())
    second = stager.capture(policy)
    assert [f.data_ptr() for f in second.flats] == [f.data_ptr() for f in first.flats]  # buffers reused
    now = engine_weights(full_state_dict(policy), True, torch.bfloat16)
    assert all(torch.equal(t, now[n]) for n, t in unpacked(second).items())
    second.discard()  # its publish failed: an aborted collective may still read these
    third = stager.capture(policy)
    assert not {f.data_ptr() for f in third.flats} & {f.data_ptr() for f in second.flats}


def test_non_senders_gather_but_keep_nothing(policy):
    stager = WeightStager(policy, tied=True, dtype=torch.bfloat16, bucket_bytes=2**16, device="cpu", is_sender=False)
    assert stager.capture(policy) is None


def test_publishers_send_staged_buffers_as_they_are(policy):
    staged = WeightStager(policy, tied=True, dtype=torch.bfloat16, bucket_bytes=2**16, device="cpu", is_sender=True).capture(policy)
    buckets = plan_for(staged, bucket_bytes=2**30, first_tiny=False)  # the staged plan, whatever is asked
    assert [b.names for b in buckets] == [b.names for b in staged.buckets]
    sent = []

    async def send(i, bucket, flat):
        sent.append((i, bucket.names, flat.data_ptr()))

    asyncio.run(send_buckets(buckets, staged, FlatBuffers(), send))
    assert sent == [(i, b.names, f.data_ptr()) for i, (b, f) in enumerate(zip(staged.buckets, staged.flats, strict=True))]


def test_two_fsdp2_ranks_stage_the_gathered_weights(tmp_path):
    """Rank 0's staged buckets after a step on two gloo ranks = the full state dict in bf16,
    packed at the sync point or streamed through two buffers."""
    out = tmp_path / "out.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    argv = [sys.executable, "-m", "trainer_daemon.torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), WORKER, str(out), "actor.loss_agg_mode=token-mean"]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (result,) = torch.load(out, weights_only=False)
    expected = engine_weights(result["weights"], True, torch.bfloat16)
    for mode in ("staged", "streamed"):  # sync.staging = buckets, two_buckets
        assert sorted(result[mode]) == sorted(expected), mode
        for name, t in expected.items():
            assert torch.equal(result[mode][name], t), (mode, name)


# -- sync.staging = two_buckets (trainer_daemon/sync/streaming.py) ---------------------------


def _consume(stream, send):
    """The publish's side in a thread of its own (as the trainer's I/O loop): send_buckets."""
    box: dict = {}

    def main():
        try:
            asyncio.run(send_buckets(plan_for(stream, 2**30, False), stream, FlatBuffers(), send))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            box["error"] = exc

    t = threading.Thread(target=main, daemon=True)
    t.start()
    return t, box


def _unpack(bucket, flat):
    spec = bucket.spec()
    return dict(zip(spec.names, (t.clone() for t in unpack_bucket(flat, spec.names, spec.dtypes, spec.shapes)), strict=True))


def test_a_stream_sends_the_engine_weights_through_two_reused_buffers(policy):
    tied = bool(policy.config.tie_word_embeddings)
    stager = WeightStager(policy, tied=tied, dtype=torch.bfloat16, bucket_bytes=2**16, device="cpu", is_sender=True)
    assert len(stager.buckets) > 4
    stream = stager.open_stream(wait_s=60)
    got, ptrs, handed = {}, [], []
    real_put = stream.put
    stream.put = lambda i, flat: (handed.append(i), real_put(i, flat))

    async def send(i, bucket, flat):
        assert max(handed) <= i + 1  # the producer is never more than one bucket ahead of the wire
        ptrs.append(flat.data_ptr())
        got.update(_unpack(bucket, flat))

    consumer, box = _consume(stream, send)
    stager.stream(policy, stream)  # the training thread: returns once the last bucket is packed
    consumer.join(30)
    assert not consumer.is_alive() and "error" not in box, box
    expected = engine_weights(full_state_dict(policy), tied, torch.bfloat16)
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name
    assert len(set(ptrs)) == 2 and ptrs[0::2] == [ptrs[0]] * len(ptrs[0::2])  # two buffers, alternating
    assert stream.timings["timing_s/sync_stage"] >= stream.timings["timing_s/sync_stage_wait"] >= 0
    again = stager.open_stream(wait_s=60)
    assert [s.data_ptr() for s in again._slots] == [s.data_ptr() for s in stream._slots]  # reused


def test_a_stream_holds_training_until_packed_and_sends_the_version_training_then_changes(policy):
    """The producer waits for the wire; once it returns, training may change the parameters:
    the last buckets, still unsent, carry the version's weights all the same."""
    stager = WeightStager(policy, tied=True, dtype=torch.bfloat16, bucket_bytes=2**16, device="cpu", is_sender=True)
    before = engine_weights(full_state_dict(policy), True, torch.bfloat16)
    stream = stager.open_stream(wait_s=60)
    last = len(stager.buckets) - 1
    trained = threading.Event()
    got = {}

    async def send(i, bucket, flat):
        if i == last - 1:
            await asyncio.to_thread(trained.wait, 30)  # the next step ran before these two were sent
        got.update(_unpack(bucket, flat))

    consumer, box = _consume(stream, send)
    stager.stream(policy, stream)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    trained.set()
    consumer.join(30)
    assert "error" not in box, box
    assert all(torch.equal(got[n], t) for n, t in before.items())


def test_a_failed_publish_frees_the_producer_and_the_next_stream_writes_new_buffers(policy):
    stager = WeightStager(policy, tied=True, dtype=torch.bfloat16, bucket_bytes=2**16, device="cpu", is_sender=True)
    stream = stager.open_stream(wait_s=60)

    async def send(i, bucket, flat):
        if i == 1:
            raise WeightSyncError("the engines went away")

    consumer, box = _consume(stream, send)
    t0 = time.monotonic()
    stager.stream(policy, stream)  # gathers to the end, writes nothing more
    assert time.monotonic() - t0 < 30
    consumer.join(30)
    assert isinstance(box.get("error"), WeightSyncError) and stream.discarded and stream.closed
    nxt = stager.open_stream(wait_s=60)
    assert not {s.data_ptr() for s in nxt._slots} & {s.data_ptr() for s in stream._slots}


def test_a_producer_nobody_consumes_gives_up_after_its_wait_and_the_publish_fails(policy):
    stager = WeightStager(policy, tied=True, dtype=torch.bfloat16, bucket_bytes=2**16, device="cpu", is_sender=True)
    stream = stager.open_stream(wait_s=0.2)
    stager.stream(policy, stream)  # buckets 0 and 1 fit the two slots; bucket 2 waits 0.2 s, then the stream closes
    assert stream.closed and stream.discarded

    async def first_three():
        assert (await stream.get(0)).numel() == stager.buckets[0].nbytes
        with pytest.raises(WeightSyncError, match="bucket 2"):
            await stream.get(2)

    asyncio.run(first_three())


def test_the_sync_controller_closes_a_stream_whose_publish_failed_before_reading_it(policy):
    class Refused(WeightPublisher):
        async def publish(self, version, weights):
            raise WeightSyncError("the sync agent is down")

    stager = WeightStager(policy, tied=True, dtype=torch.bfloat16, bucket_bytes=2**16, device="cpu", is_sender=True)
    io = IoLoop("test-io")
    try:
        ctl = SyncController(Refused(), io, version=0)
        stream = stager.open_stream(wait_s=120)
        ctl.start(stream)
        t0 = time.monotonic()
        stager.stream(policy, stream)  # would wait 120 s for bucket 0's slot to come back
        assert time.monotonic() - t0 < 30 and stream.discarded
        assert ctl.wait(30) and ctl.failures == 1
    finally:
        io.close()


def test_auto_staging_streams_only_what_a_full_copy_would_crowd(tmp_path):
    from asyncrl.config import load_config
    from trainer_daemon.sync import staging_mode, weight_sync_backend

    def mode(cfg, *sizes):
        return staging_mode(cfg.sync, cfg.actor, weight_sync_backend(cfg.trainer, cfg.engines), *sizes)

    nccl = load_config(overrides=["trainer.weight_sync_backend=nccl"], environ={})
    gloo = load_config(overrides=[], environ={})
    gib = 2**30
    assert mode(gloo, 50 * gib, 80 * gib) == "state_dict"
    assert mode(nccl, 3 * gib, 80 * gib) == "buckets"  # a 1.5B model in bf16 on an 80 GB GPU
    assert mode(nccl, 15 * gib, 80 * gib) == "two_buckets"  # a 7B
    assert mode(nccl) == "buckets"  # unknown sizes: the full copy
    pinned = load_config(overrides=["trainer.weight_sync_backend=nccl", "sync.staging=buckets"], environ={})
    assert mode(pinned, 15 * gib, 80 * gib) == "buckets"
