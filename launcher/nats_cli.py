"""``asyncrl nats [FILE] [k=v ...]``: run the run's embedded NATS JetStream server.

Starts nats-server bound to ``nats.embedded_host`` (port ``nats.embedded_port``, or a free one)
with its store in ``nats.store_dir`` (default ``<run dir>/nats``), creates the run's stream, records the URL in
``<run dir>/nats/endpoint`` (other components of the run find it there when ``nats.url`` is
unset), prints it, and runs until Ctrl-C / SIGTERM, then stops the server cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Sequence

from asyncrl.cli_args import config_parser, resolve_config
from asyncrl.config import secret
from asyncrl.jetstream import EmbeddedNats, StreamSettings, connect, ensure_stream, write_endpoint
from asyncrl.wire import NatsNames


async def _create_stream(url: str, cfg) -> str:
    nc = await connect(url, "asyncrl-nats-cli", persistent=False)
    try:
        sc = await ensure_stream(nc.jetstream(), StreamSettings.of(cfg))
        return f"stream {sc.name}: subjects {sc.subjects}, dedup window {sc.duplicate_window:.0f} s, max message {sc.max_msg_size} bytes, discard {sc.discard}"
    finally:
        await nc.close()


def main(argv: Sequence[str]) -> int:
    parser = config_parser("asyncrl nats", __doc__)
    ns = parser.parse_args(argv)
    cfg = resolve_config(ns.args)
    if cfg is None:
        return 2
    if cfg.nats.url:
        print(f"nats.url is set ({cfg.nats.url}); the embedded server is only used when it is not.", file=sys.stderr)
        return 2
    password = secret(cfg.security.nats_password)
    server = EmbeddedNats(
        cfg.run_dir, port=cfg.nats.embedded_port, max_payload=cfg.derived.max_message_bytes,
        sync_always=cfg.nats.sync_always, user=cfg.nats.user, password=password, host=cfg.nats.embedded_host,
        jetstream_dir=cfg.nats.store_dir,
    )
    stop = {"now": False}

    def _on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.start()
    try:
        write_endpoint(server)
        summary = asyncio.run(_create_stream(server.url, cfg))
        print(f"NATS JetStream ready at {server.url} (store {server.store_dir}, log {server.log_path})")
        print(summary)
        print(f"trajectory subject: {NatsNames(cfg.run.id).trajectories}. Ctrl-C to stop.", flush=True)
        while not stop["now"]:
            if not server.running:
                print(f"nats-server exited; see {server.log_path}", file=sys.stderr)
                return 1
            time.sleep(0.2)
    finally:
        server.stop()
        with contextlib.suppress(FileNotFoundError):
            (server.store_dir / "endpoint").unlink()
    print("NATS stopped.")
    return 0
