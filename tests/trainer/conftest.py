"""Fixtures for the trainer daemon's integration tests: one real nats-server per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncrl.jetstream import EmbeddedNats
from tests.helpers.nats_servers import nats_for_test


@pytest.fixture(scope="module")
def module_nats(tmp_path_factory) -> Iterator[EmbeddedNats]:
    server = nats_for_test(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
