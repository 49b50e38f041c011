"""Shared fixtures: a real embedded nats-server per test, and run configs pointing at it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.config import RunConfig, load_config
from asyncrl.jetstream import EmbeddedNats
from tests.helpers.nats_servers import nats_for_test


def pytest_configure(config: pytest.Config) -> None:
    from tests.helpers import shipped_rebuild

    shipped_rebuild.configure(config)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the long builds in the background when a collected test needs them: the tests'
    warm model, then the shipped demo policy's rebuild (tests/helpers/shipped_rebuild.py), and
    real SGLang's venv (tests/sglang_cpu/background.py)."""
    from tests.helpers import shipped_rebuild

    rebuild = any(item.nodeid.endswith(shipped_rebuild.TEST_IDS) for item in session.items)
    warm = any(shipped_rebuild.WARM_FIXTURE in getattr(item, "fixturenames", ()) for item in session.items)
    if rebuild or warm:
        shipped_rebuild.start(session.config, warm=warm, rebuild=rebuild)
    from tests.sglang_cpu import background

    if any(item.nodeid.startswith(background.TIER_DIR) for item in session.items):
        background.start(Path(os.environ[shipped_rebuild.ENV_DIR]))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item):
    """Ahead of pytest-timeout's hook: a test that will wait for an unfinished background build
    gets the build's time on top of its limit (tests/helpers/build_waits.py)."""
    from tests.helpers.build_waits import allow_for_unfinished_builds

    allow_for_unfinished_builds(item)
    yield


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A real nats-server with JetStream on 127.0.0.1, its store under tmp_path."""
    server = nats_for_test(tmp_path / "run")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def run_config(tmp_path: Path, nats_server: EmbeddedNats) -> RunConfig:
    """Defaults with the run dir in tmp_path and nats.url at the test's server."""
    return load_config(
        overrides=[f"run.dir={tmp_path / 'run'}", f"nats.url={nats_server.url}", "security.insecure_dev=true"],
        environ={},
    )
