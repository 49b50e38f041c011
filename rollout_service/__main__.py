"""``asyncrl rollout [CONFIG] [k=v ...] [--host H] [--port P] [--insecure-dev]``.

Runs the rollout service under uvicorn (default 127.0.0.1:8000 from ``rollout.host`` /
``rollout.port``). Refuses to start with an empty or weak admin token unless
``--insecure-dev``; off loopback, refuses ``--insecure-dev`` and a missing data-plane token.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from asyncrl.cli_args import config_parser, resolve_config
from asyncrl.config import secret
from asyncrl.files import private_dir
from asyncrl.http.keepalive import SERVER_KEEP_ALIVE_S
from asyncrl.launch import free_port
from asyncrl.logs import configure_logging


def argument_parser() -> argparse.ArgumentParser:
    """``asyncrl rollout``'s arguments (the launcher reads the config with it too)."""
    parser = config_parser("asyncrl rollout", __doc__)
    parser.add_argument("--host", help="bind address (default rollout.host, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default rollout.port)")
    parser.add_argument("--insecure-dev", action="store_true", help="allow an empty admin token (local development only)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = argument_parser().parse_args(sys.argv[1:] if argv is None else argv)
    cfg = resolve_config(ns.args, ["security.insecure_dev=true"] if ns.insecure_dev else [])
    if cfg is None:
        return 2
    from rollout_service.api.auth import InsecureConfig, check_tokens
    from rollout_service.prompts import data_problem

    if problem := data_problem(cfg.data):
        print(f"refusing to start: {problem}", file=sys.stderr)
        return 2

    sec = cfg.security
    host = ns.host or cfg.rollout.host
    try:
        check_tokens(secret(sec.admin_token), secret(sec.api_token), sec.insecure_dev, host)
    except InsecureConfig as exc:
        print(f"refusing to start: {exc}", file=sys.stderr)
        return 2
    configure_logging(cfg.run.log_level, json_lines=cfg.run.log_json)
    private_dir(cfg.run_dir)  # the data export and the outbox are the user's alone (issue 48)
    return asyncio.run(_serve(cfg, host, ns.port if ns.port is not None else cfg.rollout.listen_port))


def loopback_for(host: str) -> str:
    """The address this machine reaches a server bound to ``host`` at (a wildcard: loopback)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


async def _serve(cfg, host: str, port: int) -> int:
    import uvicorn

    from rollout_service.app import create_app
    from rollout_service.build import build

    if port == 0:
        port = free_port(host if host not in ("0.0.0.0", "::") else "127.0.0.1")
    svc = await build(cfg, url=f"http://{loopback_for(host)}:{port}")
    server = uvicorn.Server(uvicorn.Config(create_app(svc), host=host, port=port, log_level="warning", log_config=None, lifespan="on",
                                           timeout_keep_alive=SERVER_KEEP_ALIVE_S))
    await server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
