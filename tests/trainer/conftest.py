"""Fixtures for the trainer daemon's integration tests: one real nats-server per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncrl.jetstream import EmbeddedNats

# Every stream reserves nats.stream_max_bytes (4 GiB by default) against JetStream's store limit,
# which nats-server derives from the disk's free space: a module's streams (one per run id) fit
# whatever the machine's disk holds with the limit set. They write megabytes.
TEST_STORE_BYTES = 2**40


@pytest.fixture(scope="module")
def module_nats(tmp_path_factory) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"), max_payload=8 * 2**20, max_store_bytes=TEST_STORE_BYTES)
    server.start()
    try:
        yield server
    finally:
        server.stop()
