"""Shared fixtures: a real embedded nats-server per test, and run configs pointing at it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.config import RunConfig, load_config
from asyncrl.jetstream import EmbeddedNats


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shipped demo policy's rebuild in the background when its test will run
    (tests/helpers/shipped_rebuild.py)."""
    from tests.helpers import shipped_rebuild

    if any(item.nodeid.endswith(shipped_rebuild.TEST_ID) for item in session.items):
        shipped_rebuild.start(session.config)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A real nats-server with JetStream on 127.0.0.1, its store under tmp_path."""
    server = EmbeddedNats(tmp_path / "run", max_payload=8 * 2**20)
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
