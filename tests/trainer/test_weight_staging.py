"""The sync's device path (``sync.staging=buckets``, trainer_daemon/sync/staging.py): the
buckets packed at the sync point hold exactly the version's weights in the engines' dtype and
layout, on one rank and gathered from two FSDP2 ranks (gloo: the same code as NCCL's), stay
that version while training changes the parameters, reuse their buffers, and are replaced after
a failed publish. The publishers send them as they are (plan_for, send_buckets)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.launch import free_port
from asyncrl.weight_sync import unpack_bucket
from trainer_daemon.model import build_policy, engine_weights, full_state_dict
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
    """Rank 0's staged buckets after a step on two gloo ranks = the full state dict in bf16."""
    out = tmp_path / "out.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    argv = [sys.executable, "-m", "trainer_daemon.torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), WORKER, str(out), "actor.loss_agg_mode=token-mean"]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (result,) = torch.load(out, weights_only=False)
    expected = engine_weights(result["weights"], True, torch.bfloat16)
    assert sorted(result["staged"]) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(result["staged"][name], t), name
