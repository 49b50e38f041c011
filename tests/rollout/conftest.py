"""Fixtures for rollout-service tests: a warm tiny model, engines, and the service running
under uvicorn on a loopback port."""

from __future__ import annotations

import contextlib
from pathlib import Path

import aiohttp
import pytest

from asyncrl.config import load_config
from launcher.demo_data import demo_data_env
from tests.helpers.loopback_socket import loopback_socket, serving
from tests.helpers.processes import start_engine
from tests.helpers.waiting import wait_for
from tests.helpers.warm_model import warm_tiny_model

ADMIN = "test-admin-token-0123456789"


@pytest.fixture(scope="session")
def warm_model() -> Path:
    return warm_tiny_model()


@pytest.fixture(scope="module")
def warm_engine(warm_model: Path, tmp_path_factory):
    with start_engine(tmp_path_factory.mktemp("engine-logs"), model=str(warm_model)) as engine:
        yield engine.url


@pytest.fixture
async def install_version():
    """``await install_version(engine_url, v)``: the engine now says it serves version ``v``, as
    a completed sync leaves it (``/update_weight_version``; the rollout service resumes only to a
    version an engine serves, issue 67). Shared engines are put back to version 0 afterwards."""
    from asyncrl.engine_client import EngineClient

    touched: list[str] = []

    async def install(url: str, version: int) -> None:
        async with EngineClient(url) as client:
            await client.update_weight_version(version, abort_all_requests=False)
        touched.append(url)

    yield install
    for url in dict.fromkeys(touched):
        async with EngineClient(url) as client:
            await client.update_weight_version(0, abort_all_requests=False)


def service_config(tmp_path: Path, nats_url: str, engine_urls: list[str], *overrides: str):
    """The service's config; with no data of its own, the demo task's files, as ``asyncrl rollout``
    gives them (launcher.demo_data)."""
    base = [f"run.dir={tmp_path / 'run'}", f"nats.url={nats_url}", f"engines.urls={engine_urls!r}".replace("'", '"'),
            f"security.admin_token={ADMIN}", "rollout.n=2", "actor.ppo_mini_batch_size=2"]
    cfg = load_config(overrides=[*base, *overrides], environ={})
    demo = demo_data_env(cfg)
    return load_config(overrides=[*base, *overrides], environ=demo) if demo else cfg


@contextlib.asynccontextmanager
async def running_service(cfg):
    """The rollout service with its app on a free loopback port; yields (service, base_url)."""
    from rollout_service.app import create_app
    from rollout_service.build import build

    sock = loopback_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    svc = await build(cfg, url=url)
    async with serving(sock, create_app(svc), "the rollout service"):
        yield svc, url


async def admin(session: aiohttp.ClientSession, method: str, url: str, json=None, token: str | None = ADMIN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with session.request(method, url, json=json, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def consume_as_trainer(nats_url: str, run_id: str, timeout_s: float = 30.0) -> int:
    """Ack every trajectory in the run's stream on the trainer's durable consumer, as the
    trainer would after a step; returns how many it acked. After this the service's queue
    probe reads zero unconsumed trajectories."""
    from nats.js.api import AckPolicy, ConsumerConfig

    from asyncrl.jetstream import connect
    from asyncrl.wire import NatsNames

    names = NatsNames(run_id)
    nc = await connect(nats_url, "test-trainer", persistent=False)
    acked = 0
    try:
        js = nc.jetstream()
        await js.add_consumer(names.stream, ConsumerConfig(durable_name=names.trainer_consumer,
                                                           filter_subject=names.trajectories, ack_policy=AckPolicy.EXPLICIT))
        sub = await js.pull_subscribe_bind(durable=names.trainer_consumer, stream=names.stream)

        async def all_acked() -> bool:
            nonlocal acked
            info = await js.consumer_info(names.stream, names.trainer_consumer)
            if info.num_pending + info.num_ack_pending == 0:
                return True
            try:
                msgs = await sub.fetch(50, timeout=1)
            except TimeoutError:
                return False
            for m in msgs:
                await m.ack_sync()
                acked += 1
            return False

        await wait_for(all_acked, timeout_s, "the trainer's consumer to ack the whole stream", interval_s=0)
        return acked
    finally:
        await nc.close()
