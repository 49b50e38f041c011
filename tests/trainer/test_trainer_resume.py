"""Checkpoint and crash recovery of a 2-rank torchrun trainer on a real nats-server.

- Exact resume: 3 uninterrupted steps vs 2 steps (async checkpoints) + a restart for the 3rd
  give bitwise-identical weights (model, optimiser, LR schedule, stream cursor all restored).
- SIGKILL at random moments (seeded): the trainer is killed three times — the agent alone
  (its workers must die with it), the whole process tree at once, rank 0's worker alone — and
  restarted; the final run finishes. Along the surviving checkpoint lineage every published
  trajectory is resolved exactly once: trained, or counted separately (duplicate id, poison).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.config import load_config
from asyncrl.jetstream import connect
from asyncrl.wire import NatsNames, encode_trajectory
from tests.helpers.processes import alive, process_tree
from tests.helpers.waiting import wait_for_sync
from tests.trainer.helpers import (
    NOT_YET,
    latest_export,
    make_group,
    metrics_lines,
    publish,
    publish_raw,
    start_trainer,
    wait_exit,
)
from trainer_daemon.audit import audit_run
from trainer_daemon.state.checkpoint import complete_checkpoints, read_state
from trainer_daemon.state.ledger import read_lineage

N = 2
GROUPS_PER_STEP = 2
KILL_SEED = 20261122
STEP_WAIT_S = 180.0  # a restart imports torch + transformers on two busy cores
DEATH_WAIT_S = 15.0


def overrides(run_dir: Path, nats_url: str, run_id: str, *extra: str) -> list[str]:
    return [f"run.dir={run_dir}", f"nats.url={nats_url}", f"run.id={run_id}", f"rollout.n={N}",
            f"actor.ppo_mini_batch_size={GROUPS_PER_STEP}", "actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.metrics_port=0", "actor.optim.lr=1e-3", "actor.optim.warmup_steps=2",
            "actor.optim.lr_scheduler=cosine", *extra]


def run_to_end(run_dir: Path, ov: list[str], name: str) -> None:
    proc = start_trainer(run_dir, ov, nproc=2, name=name)
    try:
        assert wait_exit(proc) == 0, proc.failure("failed")
    finally:
        proc.stop()


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(module_nats, tmp_path):
    rng = random.Random(3)
    trajs = [t for g in range(3 * GROUPS_PER_STEP) for t in make_group(rng, f"r{g}", N)]
    a_dir, b_dir = tmp_path / "a" / "run", tmp_path / "b" / "run"
    a = overrides(a_dir, module_nats.url, "resume-a", "trainer.total_training_steps=3")
    b = overrides(b_dir, module_nats.url, "resume-b", "trainer.checkpoint.save_freq=1", "trainer.checkpoint.async_save=true")
    publish(load_config(overrides=a, environ={}), trajs)
    publish(load_config(overrides=b, environ={}), trajs)
    run_to_end(a_dir, a, "a")
    run_to_end(b_dir, [*b, "trainer.total_training_steps=2"], "b1")
    assert [s for s, _ in complete_checkpoints(b_dir / "checkpoints")] == [1, 2]
    run_to_end(b_dir, [*b, "trainer.total_training_steps=3"], "b2")
    wa = (latest_export(a_dir) / "model.safetensors").read_bytes()
    wb = (latest_export(b_dir) / "model.safetensors").read_bytes()
    assert read_state(latest_export(b_dir).parent)["step"] == 3
    assert wa == wb, "resumed weights differ from the uninterrupted run"
    la, lb = metrics_lines(a_dir), metrics_lines(b_dir)
    assert [x["actor/lr"] for x in la] == [x["actor/lr"] for x in lb]


def _workers(pid: int) -> list[psutil.Process]:
    return [p for p in process_tree(pid)[1:] if "trainer_daemon" in " ".join(p.cmdline()) and "torchrun" not in " ".join(p.cmdline())]


def _kill(proc, mode: str) -> list[psutil.Process]:
    """SIGKILL part of the trainer; returns every process of its tree (to check they all die)."""
    tree = process_tree(proc.pid)
    workers = _workers(proc.pid)
    targets = {"agent": tree[:1], "all": tree, "rank0": [w for w in workers if "trainer_daemon" in " ".join(w.cmdline())][:1]}[mode]
    if mode == "rank0":
        targets = [w for w in workers if w.environ().get("RANK") == "0"]
    for p in targets:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree


async def _stream_counts(url: str, cfg) -> int:
    nc = await connect(url, "test-inspect", persistent=False)
    try:
        js = nc.jetstream()
        names = NatsNames(cfg.run.id)
        info = await js.stream_info(names.stream, subjects_filter=names.trajectories)
        return int(info.state.messages)
    finally:
        await nc.close()


def test_sigkill_at_random_points_trains_every_trajectory_exactly_once(module_nats, tmp_path):
    steps = 8
    run_dir = tmp_path / "chaos" / "run"
    ov = overrides(run_dir, module_nats.url, "chaos", f"trainer.total_training_steps={steps}", "trainer.checkpoint.save_freq=1",
                   "trainer.checkpoint.async_save=true", "trainer.checkpoint.keep_last=2", "trainer.checkpoint.export_hf=false")
    cfg = load_config(overrides=ov, environ={})
    rng = random.Random(KILL_SEED)
    trajs = [t for g in range(steps * GROUPS_PER_STEP) for t in make_group(rng, f"k{g}", N, run_id=cfg.run.id)]
    half = len(trajs) // 2
    publish(cfg, trajs[:half])
    poison_seqs = publish_raw(cfg, [(b"\x00garbage", "poison-a")])
    dup_seq = publish_raw(cfg, [(encode_trajectory(trajs[0]), "republished-k0-0")])  # same trajectory id, new message id
    publish(cfg, trajs[half:])
    poison_seqs += publish_raw(cfg, [(b"\x81\xa6schema\xb4asyncrl.trajectory/7", "poison-b")])

    for i, mode in enumerate(("agent", "all", "rank0")):
        before = len(metrics_lines(run_dir))
        proc = start_trainer(run_dir, ov, nproc=2, name=f"chaos-{i}")
        try:
            wait_for_sync(lambda b=before: len(metrics_lines(run_dir)) > b, STEP_WAIT_S, "a new step", procs=[proc],
                          retry_on=NOT_YET, interval_s=0.05)
            time.sleep(rng.uniform(0.0, 1.5))  # not a wait for a state: a random kill point inside the next step
            if proc.poll() is not None:
                pytest.fail(f"trainer exited before kill {i}: {proc.failure('exited')}")
            tree = _kill(proc, mode)
            wait_for_sync(lambda t=tree: not alive(t), DEATH_WAIT_S, f"kill {i} ({mode}): every process of the trainer to die")
        finally:
            proc.kill()

    run_to_end(run_dir, ov, "chaos-final")
    final_step, final_dir = complete_checkpoints(run_dir / "checkpoints")[-1]
    assert final_step == steps
    entries = read_lineage(run_dir / "checkpoints", final_step)
    trained = [i for e in entries for i in e["trained"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice along the lineage"
    assert sorted(trained) == sorted(t.id for t in trajs), "trained set differs from the published set"
    assert [e["step"] for e in entries if not e.get("between_steps")] == list(range(1, steps + 1))
    assert sorted(s for e in entries for s in e.get("poison", [])) == sorted(poison_seqs)
    assert [i for e in entries for i in e.get("duplicate", [])] == [trajs[0].id] and dup_seq
    counters = read_state(final_dir)["consumption"]["counters"]
    assert counters["trained"] == len(trajs) and counters["poison"] == 2 and counters["duplicate"] == 1
    remaining = asyncio.run(_stream_counts(module_nats.url, cfg))
    assert remaining < len(trajs) + 1, "the stream was never purged below the checkpoint cursor"
    # the operator's check (asyncrl audit): every stream sequence accounted for, nothing twice
    audit = asyncio.run(audit_run(run_dir, module_nats.url, "chaos"))
    assert audit.ok and (audit.lost, audit.twice, audit.pending) == (0, 0, 0), audit
    assert (audit.trained, audit.poison, audit.duplicate, audit.dlq) == (len(trajs), 2, 1, 2), audit
    assert audit.published == len(trajs) + 3
