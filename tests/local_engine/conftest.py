"""Fixtures: real local_engine processes (builtin:tiny) and the same model in-process."""

from __future__ import annotations

import pytest

from asyncrl import failpoints
from tests.helpers.processes import Engine, start_engine
from tests.helpers.reference_model import load_reference_model


@pytest.fixture(scope="session")
def engine(tmp_path_factory) -> Engine:
    """The shared engine for tests that leave it as they found it (not paused, default weights)."""
    with start_engine(tmp_path_factory.mktemp("engine"), name="engine") as e:
        yield e


@pytest.fixture(scope="session")
def small_engine(tmp_path_factory) -> Engine:
    """An engine with --max-batch-size 2 (queued requests exist) for pause and queue tests; its
    failpoints (``local_engine.step``) live in ``<its log dir>/failpoints``."""
    d = tmp_path_factory.mktemp("small")
    (d / "failpoints").mkdir()
    with start_engine(d, "--max-batch-size", "2", name="small-engine", env={failpoints.ENV_DIR: str(d / "failpoints")}) as e:
        e.failpoints = d / "failpoints"
        yield e


@pytest.fixture(scope="session")
def ref_model():
    """builtin:tiny with the engine's seed, in this process, for teacher forcing."""
    return load_reference_model()


@pytest.fixture
async def client(engine: Engine):
    async with engine.client() as c:
        yield c


@pytest.fixture
async def small_client(small_engine: Engine):
    async with small_engine.client() as c:
        yield c
        await c.resume()  # never leave the shared engine paused, whatever the test did
