"""Fixtures: one real local_engine process, and an "old SGLang" stand-in server in-process."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from engine_fixtures import EngineProc, running_engine  # noqa: E402

from asyncrl.launch import free_port  # noqa: E402

STUB_START_TIMEOUT_S = 20.0


@pytest.fixture(scope="session")
def client_engine(tmp_path_factory) -> EngineProc:
    with running_engine(tmp_path_factory.mktemp("client-engine"), name="client-engine") as e:
        yield e


@pytest.fixture(scope="module")
def old_server():
    """A real uvicorn server (in a thread) answering like an old SGLang build; see old_sglang.py."""
    import uvicorn
    from old_sglang import build_app

    app, state = build_app()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + STUB_START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("old-SGLang stand-in did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(10)
