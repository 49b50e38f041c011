"""Helpers for the trainer daemon's integration tests: synthetic trajectory groups with a
learnable signal, publishing to a real JetStream, running the trainer under torchrun, and
reading what it left in the run directory.

The learnable task: every group has ``n`` trajectories after one random prompt; half answer
with the token run ``GOOD`` (reward 1), half with ``BAD`` (reward 0). GRPO should raise the
log-probability of ``GOOD`` after any prompt relative to ``BAD``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import sys
from pathlib import Path

import msgspec

from asyncrl.jetstream import StreamSettings, connect, ensure_stream
from asyncrl.launch import ChildProcess
from asyncrl.wire import NatsNames, Trajectory, encode_trajectory
from tests.helpers.waiting import wait_for_sync

GOOD = [101, 102, 103, 104]
BAD = [201, 202, 203, 204]
PROMPT_LEN = 6
TRAINER_EXIT_S = 240.0  # torch + transformers import on 2 busy cores, plus the run itself
NOT_YET = (OSError, ValueError, http.client.HTTPException)  # for waits: a file or endpoint the trainer is still writing or opening


def make_group(rng: random.Random, gid: str, n: int, version: int = 0, logprob: float = -7.0, run_id: str = "test") -> list[Trajectory]:
    prompt = [rng.randrange(300, 1500) for _ in range(PROMPT_LEN)]
    out = []
    for i in range(n):
        good = i % 2 == 0
        resp = GOOD if good else BAD
        out.append(Trajectory(
            id=f"{gid}-{i}", run_id=run_id, group_id=gid, group_size=n, group_index=i, prompt_id=gid,
            data_source="synthetic", token_ids=prompt + resp, prompt_length=len(prompt),
            loss_mask=[1] * len(resp), rollout_logprobs=[logprob] * len(resp), weight_versions=[version] * len(resp),
            reward=1.0 if good else 0.0, version_start=version, version_end=version, temperature=1.0,
        ))
    return out


async def _publish(url: str, cfg, items: list[tuple[bytes, str]]) -> list[int]:
    nc = await connect(url, "test-publisher", persistent=False)
    try:
        js = nc.jetstream()
        await ensure_stream(js, StreamSettings.of(cfg))
        subject = NatsNames(cfg.run.id).trajectories
        seqs = []
        for payload, msg_id in items:
            ack = await js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id}, timeout=10)
            seqs.append(ack.seq)
        return seqs
    finally:
        await nc.close()


def publish(cfg, trajs: list[Trajectory]) -> list[int]:
    """Publish trajectories (``Nats-Msg-Id`` = id) as ``cfg``'s run's (the trainer admits only
    its own run's: trainer_daemon/consume/admission.py); returns their stream sequences."""
    own = [msgspec.structs.replace(t, run_id=cfg.run.id) for t in trajs]
    return asyncio.run(_publish(cfg.nats.url, cfg, [(encode_trajectory(t), t.id) for t in own]))


def publish_raw(cfg, payloads: list[tuple[bytes, str]]) -> list[int]:
    """Publish raw payloads with the given message ids (poison, duplicates)."""
    return asyncio.run(_publish(cfg.nats.url, cfg, payloads))


async def _read_subject(url: str, cfg, subject: str) -> list:
    nc = await connect(url, "test-reader", persistent=False)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(subject, durable=None, stream=NatsNames(cfg.run.id).stream)
        out = []
        while True:
            try:
                msgs = await sub.fetch(100, timeout=1.0)
            except Exception:  # noqa: BLE001 - timeout: nothing more
                return out
            out.extend(msgs)
    finally:
        await nc.close()


def read_subject(cfg, subject: str) -> list:
    return asyncio.run(_read_subject(cfg.nats.url, cfg, subject))


def overrides_for(cfg_overrides: list[str]) -> list[str]:
    return list(cfg_overrides)


def start_trainer(run_dir: Path, overrides: list[str], nproc: int = 1, name: str = "trainer") -> ChildProcess:
    """``asyncrl trainer`` (torchrun under the loopback wrapper) as a child process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "launcher", "trainer", f"trainer.nproc_per_node={nproc}", *overrides]
    return ChildProcess(name, argv, Path(run_dir) / "logs" / f"{name}.log", env=env).start()


def wait_exit(proc: ChildProcess, timeout_s: float = TRAINER_EXIT_S) -> int:
    """The trainer's exit code; killed and failed with its log tail if it runs past ``timeout_s``."""
    try:
        wait_for_sync(lambda: proc.poll() is not None, timeout_s, f"{proc.name} to exit")
    except AssertionError:
        proc.kill()
        raise proc.failure(f"did not exit within {timeout_s:.0f} s") from None
    return proc.poll()


def metrics_lines(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics" / "trainer.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def listening_sockets(pid: int) -> list[tuple[str, int, int]]:
    """``(ip, port, pid)`` of every TCP socket in LISTEN state in ``pid``'s process tree."""
    import psutil

    root = psutil.Process(pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out += [(c.laddr.ip, c.laddr.port, p.pid) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def scrape(url: str) -> dict[str, float]:
    """Prometheus text → {name: value} (unlabelled samples only)."""
    import urllib.request

    body = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def latest_export(run_dir: Path) -> Path:
    from trainer_daemon.state.checkpoint import complete_checkpoints

    found = complete_checkpoints(Path(run_dir) / "checkpoints")
    assert found, f"no complete checkpoint in {run_dir}"
    return found[-1][1] / "hf"
