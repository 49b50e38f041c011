"""Starting real asyncrl processes (engines, services) on free loopback ports for tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from asyncrl.launch import ChildProcess, free_port, http_ok

ENGINE_READY_S = 120.0  # a cold import of torch + transformers on a loaded 2-core CI box


def start_engine(log_dir: Path, model: str = "builtin:tiny", *extra: str, port: int | None = None,
                 env: dict[str, str] | None = None) -> tuple[ChildProcess, str]:
    """A local_engine process; returns it and its base URL once /health answers. ``env``:
    extra environment variables (e.g. SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT``)."""
    port = port or free_port()
    proc = ChildProcess(
        f"engine:{port}",
        [sys.executable, "-m", "asyncrl", "engine", "--model", model, "--port", str(port), *extra],
        Path(log_dir) / f"engine-{port}.log", env={**os.environ, **(env or {})},
    ).start()
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_ready(lambda: http_ok(f"{url}/health"), ENGINE_READY_S)
    except Exception:
        proc.stop()
        raise
    return proc, url
