"""``asyncrl python-sandbox``: the python tool's runs in a process of their own, served on a
unix socket, for services that cannot isolate model code themselves (compose: uid 10001,
``cap_drop: ALL``). Run it in its own container (compose's ``python-sandbox`` service): no
network, no secrets in its environment, a read-only root, a tmpfs for the runs, process,
memory and CPU limits; as root with only SETUID, SETGID, CHOWN, KILL, DAC_OVERRIDE and
FOWNER, so every run still gets its own uid (:mod:`tools.python_sandbox`).

    asyncrl python-sandbox --socket /run/asyncrl-sandbox/python.sock --owner 10001 [--limits JSON]

- Start: builds a :class:`~tools.python_sandbox.PythonSandbox` with ``--limits``
  (``PythonSandboxConfig`` fields as JSON), which checks the isolation it can give and
  refuses to start without it (exit 2, the reason on stderr). Then binds the socket
  (``0600``, owned by ``--owner``: only that uid, the rollout service's, may connect; the
  runs' own uids may not), replacing a stale one.
- ``POST /v1/run`` ``{"code": str, "timeout_s": float}`` → ``{"content", "is_error",
  "metadata"}`` (the tool result; ``timeout_s`` is capped by the server's ``wall_timeout_s``).
  A bad body is a 400 naming the problem.
- ``GET /health`` → ``{"isolation": <the launcher's report of the start-up probe>}``.

Not covered: TCP (a network the runs could reach), authentication beyond the socket's mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asyncrl.http.keepalive import SERVER_KEEP_ALIVE_S
from tools.python_sandbox import PythonSandbox, PythonSandboxConfig, SandboxUnavailable

DEFAULT_SOCKET = "/run/asyncrl-sandbox/python.sock"


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    timeout_s: float = Field(gt=0.0, le=3600.0)


def create_app(sandbox: PythonSandbox) -> FastAPI:
    app = FastAPI(title="asyncrl python sandbox", docs_url=None, redoc_url=None)

    @app.post("/v1/run")
    async def run(request: Request) -> JSONResponse:
        try:
            body = RunRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            problem = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
            return JSONResponse({"error": {"message": problem, "code": 400}}, status_code=400)
        result = await sandbox.call({"code": body.code}, timeout_s=body.timeout_s)
        return JSONResponse({"content": result.content, "is_error": result.is_error, "metadata": _jsonable(result.metadata)})

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"isolation": sandbox.isolation}

    return app


def _jsonable(metadata: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(metadata, default=str))


def bind_socket(path: str, owner: int | None) -> socket.socket:
    """A listening unix socket at ``path`` (a stale file there is replaced), mode 0600, owned
    by ``owner`` (default: this process's uid)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    if owner is not None:
        os.chown(path, owner, -1)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


async def _serve(sandbox: PythonSandbox, sock: socket.socket) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(sandbox), log_level="warning", log_config=None, lifespan="off",
                                           timeout_keep_alive=SERVER_KEEP_ALIVE_S))
    await server.serve(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl python-sandbox", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help=f"unix socket to serve on (default {DEFAULT_SOCKET})")
    parser.add_argument("--owner", type=int, help="uid that may connect (the rollout service's); default: this process's")
    parser.add_argument("--limits", default="{}", help="PythonSandboxConfig fields as JSON (wall_timeout_s, memory_mb, ...)")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = PythonSandboxConfig(**json.loads(ns.limits))
        if config.sandbox_url:
            raise ValueError("a sandbox server runs the programs itself: sandbox_url must not be set")
        sandbox = PythonSandbox(config)
    except (ValueError, SandboxUnavailable) as exc:
        print(f"refusing to start: {exc}", file=sys.stderr)
        return 2
    sock = bind_socket(ns.socket, ns.owner)
    print(f"python sandbox on unix://{ns.socket} (isolation: network {sandbox.isolation.get('network')}, "
          f"pid namespace {sandbox.isolation.get('pid_namespace')})", file=sys.stderr, flush=True)
    asyncio.run(_serve(sandbox, sock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
