"""``asyncrl sync-agent [CONFIG] [k=v ...] [--host H] [--port P] [--insecure-dev]``.

Runs the sync agent under uvicorn (default 127.0.0.1:8100 from ``sync.host`` / ``sync.port``).
Refuses to start without a sync token (``security.sync_token``) unless ``--insecure-dev``,
which binds loopback only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from asyncrl.cli_args import config_parser, resolve_config
from asyncrl.config import secret
from asyncrl.files import private_dir
from asyncrl.http.binding import bind_refusal
from asyncrl.http.keepalive import SERVER_KEEP_ALIVE_S
from asyncrl.logs import configure_logging


def main(argv: Sequence[str] | None = None) -> int:
    parser = config_parser("asyncrl sync-agent", __doc__)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--insecure-dev", action="store_true", help="allow running without a sync token")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = resolve_config(ns.args, ["security.insecure_dev=true"] if ns.insecure_dev else [])
    if cfg is None:
        return 2
    token = secret(cfg.security.sync_token) or ""
    host = ns.host or cfg.sync.host
    refusal = bind_refusal(host, cfg.security.insecure_dev, len(token) >= 12, "security.sync_token (ASYNCRL_SECURITY__SYNC_TOKEN)")
    if refusal:
        print(f"refusing to start: {refusal}", file=sys.stderr)
        return 2
    if not cfg.security.insecure_dev and len(token) < 12:
        print("refusing to start: security.sync_token is empty or shorter than 12 characters "
              "(set ASYNCRL_SECURITY__SYNC_TOKEN or pass --insecure-dev)", file=sys.stderr)
        return 2
    configure_logging(cfg.run.log_level, json_lines=cfg.run.log_json)
    private_dir(cfg.run_dir)
    import uvicorn

    from sync_agent.agent import SyncAgent
    from sync_agent.app import create_app

    port = ns.port if ns.port is not None else cfg.sync.listen_port
    uvicorn.run(create_app(SyncAgent(cfg)), host=host, port=port, log_level="warning", log_config=None,
                timeout_keep_alive=SERVER_KEEP_ALIVE_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
