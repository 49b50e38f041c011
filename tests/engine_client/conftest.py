"""Fixtures: one real local_engine process, and an "old SGLang" stand-in server in-process."""

from __future__ import annotations

import threading

import pytest

from tests.helpers.loopback_socket import loopback_socket
from tests.helpers.processes import Engine, start_engine
from tests.helpers.waiting import wait_for_sync

STUB_START_TIMEOUT_S = 20.0


@pytest.fixture(scope="session")
def client_engine(tmp_path_factory) -> Engine:
    with start_engine(tmp_path_factory.mktemp("client-engine"), name="client-engine") as e:
        yield e


@pytest.fixture(scope="module")
def old_server():
    """A real uvicorn server (in a thread) answering like an old SGLang build; see old_sglang.py."""
    import uvicorn

    from tests.engine_client.old_sglang import build_app

    app, state = build_app()
    sock = loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for_sync(lambda: server.started or not thread.is_alive(), STUB_START_TIMEOUT_S, "the old-SGLang stand-in to start",
                      interval_s=0.01)
        assert server.started, "the old-SGLang stand-in exited during startup"
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
