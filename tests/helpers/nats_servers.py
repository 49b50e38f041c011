"""The tests' nats-servers: real ones (``EmbeddedNats``), with a store limit of their own.

Every stream reserves ``nats.stream_max_bytes`` (4 GiB by default) against JetStream's store
limit, and nats-server's own default is 75 % of the disk's free space when it starts, so
whether a test's streams fit would depend on what else the disk holds (CI once failed so, with
16 GB left on it by another tier). The tests write megabytes; the limit is set far above.
What a full store does is tested on purpose (tests/foundation/test_nats.py).
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.jetstream import EmbeddedNats

TEST_STORE_BYTES = 2**40


def nats_for_test(run_dir: Path, max_payload: int = 8 * 2**20) -> EmbeddedNats:
    """An (unstarted) nats-server for a test, its store under ``run_dir``."""
    return EmbeddedNats(run_dir, max_payload=max_payload, max_store_bytes=TEST_STORE_BYTES)
