"""Fixtures for the trainer daemon's integration tests: one real nats-server per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncrl.jetstream import EmbeddedNats


@pytest.fixture(scope="module")
def module_nats(tmp_path_factory) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"), max_payload=8 * 2**20)
    server.start()
    try:
        yield server
    finally:
        server.stop()
