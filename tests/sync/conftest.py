"""Fixtures for sync-agent tests: two real engines, the rollout service, the sync agent (all
on loopback), and the trainer's real side of the protocol (``SyncAgentPublisher``)."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import pytest
import torch

from asyncrl.models import load_model
from tests.helpers.loopback_socket import loopback_socket, serving
from tests.helpers.processes import Engine, start_engine
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import running_service, service_config

SYNC_TOKEN = "sync-token-0123456789"
# An engine left in a failed sync's collective (its sender or a peer gone) waits this long
# before it answers again, like SGLang waits for its process group's timeout (minutes there).
IN_PLACE_SAFE = ("--disable-radix-cache", "--disable-overlap-schedule")
"""What the sync agent requires of engines for in_place pauses (issue 66 N1, N2)."""
ENGINE_ARGS = ("--weight-sync-timeout-s", "15", *IN_PLACE_SAFE)


@pytest.fixture
def engines(tmp_path) -> list[Engine]:
    started: list[Engine] = []
    try:
        for i in range(2):
            started.append(start_engine(tmp_path, *ENGINE_ARGS, name=f"engine-{i}"))
        yield started
    finally:
        for engine in started:  # all told at once: each may sit out uvicorn's graceful window
            engine.proc.signal(signal.SIGTERM)
        for engine in started:
            engine.stop()


@pytest.fixture
def restart_engine(tmp_path):
    """``restart_engine(port, name)``: an engine of the same kind as ``engines`` started again
    on ``port`` (a context manager); tests/sglang/conftest.py gives a real SGLang one."""
    return lambda port, name: start_engine(tmp_path, *ENGINE_ARGS, port=port, name=name)


PROGRESS_WINDOW_S = 5.0  # the health blocks' window: "progressing" means tokens decoded in the last 5 s


def config(tmp_path, nats_url, engine_urls, *extra):
    return service_config(tmp_path, nats_url, engine_urls, f"security.sync_token={SYNC_TOKEN}", "rollout.n=2",
                          "async_training.staleness_threshold=100", "sync.reconcile_interval_s=0.5",
                          "sync.broadcast_timeout_s=30", "sync.group_init_timeout_s=30", "sync.pause_timeout_s=30",
                          f"run.progress_window_s={PROGRESS_WINDOW_S}", *extra)


@contextlib.asynccontextmanager
async def running_agent(cfg):
    from sync_agent.agent import SyncAgent
    from sync_agent.app import create_app

    agent = SyncAgent(cfg)
    sock = loopback_socket()
    async with serving(sock, create_app(agent), "the sync agent"):
        yield agent, f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.asynccontextmanager
async def stack(tmp_path, nats_url, engine_urls, *extra):
    """Rollout service + sync agent wired together (the agent pauses/resumes the service)."""
    cfg0 = config(tmp_path, nats_url, engine_urls, *extra)
    async with running_service(cfg0) as (svc, rollout_url):
        cfg = config(tmp_path, nats_url, engine_urls, f"sync.rollout_url={rollout_url}", *extra)
        async with running_agent(cfg) as (agent, agent_url):
            yield svc, rollout_url, agent, agent_url, cfg


def publisher(agent_url: str, cfg, bucket_bytes: int = 1 << 20):
    from trainer_daemon.sync.agent import SyncAgentPublisher

    s = cfg.sync
    return SyncAgentPublisher(agent_url, SYNC_TOKEN, master_address="127.0.0.1", bucket_bytes=bucket_bytes,
                              group_timeout_s=s.group_init_timeout_s, pause_timeout_s=s.pause_timeout_s,
                              broadcast_timeout_s=s.broadcast_timeout_s)


def perturbed_weights(seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """builtin:tiny with every parameter nudged (a stand-in for a trained policy)."""
    model = load_model("builtin:tiny")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


async def service_idle(svc, engine) -> bool:
    """The rollout service runs no agent and the engine no request."""
    from asyncrl.engine_client import EngineClient

    if svc.runner.snapshot().active:
        return False
    async with EngineClient(engine.url) as c:
        return (await c.loads())["loads"][0]["num_running_reqs"] == 0


async def engine_tokens_over(engine, over: int) -> bool:
    """The engine holds more than ``over`` tokens (prompt + decoded) in its running requests."""
    from asyncrl.engine_client import EngineClient

    async with EngineClient(engine.url) as c:
        return (await c.loads())["loads"][0]["num_total_tokens"] > over


async def slow_down(engine, seconds: float | None) -> None:
    """SGLang's ``/slow_down`` (local_engine serves it too): each forward sleeps ``seconds``
    first, or at full speed again with None. A generation then decodes slowly enough to be met
    mid-way by a sync on any engine, deterministically: it is released only after the sync's
    pause reached the engine (:func:`sync_through_a_slowed_engine`)."""
    async with engine.client() as c:
        await c._call("POST", "/slow_down", {"forward_sleep_time": seconds}, admin=True)


async def sync_through_a_slowed_engine(engine, proxy, publish) -> None:
    """Run ``publish`` (a sync) while ``engine`` is slowed down (:func:`slow_down`), give it its
    speed back once the sync's ``/pause_generation`` has reached it (seen at ``proxy``), and wait
    for the sync: a generation in flight on it is always met by the pause."""

    task = asyncio.create_task(publish)
    try:
        await wait_for(lambda: any(path == "/pause_generation" for _, path, _, _ in proxy.requests) or task.done(),
                       180.0, "the sync's pause to reach the engine")
    finally:
        await slow_down(engine, None)
    await task


async def sync_through_the_held_step(points, proxy, publish) -> None:
    """Run ``publish`` (a sync) while the engine is held at its ``local_engine.step`` failpoint
    (armed and reached), release the engine once the sync's ``/pause_generation`` has reached it
    (seen at ``proxy``), and wait for the sync: it always meets the generation in flight."""

    task = asyncio.create_task(publish)
    await wait_for(lambda: any(path == "/pause_generation" for _, path, _, _ in proxy.requests) or task.done(),
                   180.0, "the sync's pause to reach the engine")
    (points / "local_engine.step.release").touch()
    (points / "local_engine.step.arm").unlink()
    await task
