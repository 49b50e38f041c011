"""``asyncrl engine ...`` / ``python -m local_engine ...``: parse flags, build, serve.

    asyncrl engine --model builtin:tiny --host 127.0.0.1 --port 30000 \\
        [--dtype float32|bfloat16] [--seed 0] [--max-batch-size 32] [--max-model-len N] \\
        [--sglang-compat 0.5.23] [--tp-size N] [--device cpu|cuda] [--timing-mode ...] \\
        [--port-slots N --slot-dir DIR --addr-file PATH]   # a slot's port, port+k (replicas on one host)

Every flag is a field of :class:`local_engine.settings.EngineSettings` (``--help`` lists them;
``EngineSettings.from_argv`` parses them, environment variables included). A bad value exits
with status 2 and a line naming the field and its flag. Off loopback the engine needs an api
key of 12+ characters (its environment), else it refuses to start (issue 48). torch and transformers are imported
only after the flags parsed (``--help`` is instant).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from asyncrl.http.keepalive import SERVER_KEEP_ALIVE_S

GRACEFUL_SHUTDOWN_S = 5  # uvicorn waits this long for open requests after SIGTERM


def main(argv: Sequence[str] | None = None) -> int:
    from asyncrl.logs import configure_logging
    from local_engine.settings import EngineSettings, SettingsError

    try:
        settings = EngineSettings.from_argv(list(sys.argv[1:] if argv is None else argv))
    except SettingsError as exc:
        print(f"asyncrl engine: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    from asyncrl.http.binding import bind_refusal

    # like the other services (issue 48): off loopback, the engine needs its key (SGLang starts
    # open anywhere; asyncrl's own engine does not)
    refusal = bind_refusal(settings.host, False, len(settings.api_key or "") >= 12,
                           "the engine's api key (LOCAL_ENGINE_API_KEY or LOCAL_ENGINE_API_KEY_FILE)")
    if refusal:
        print(f"asyncrl engine: refusing to start: {refusal}", file=sys.stderr)
        return 2
    from asyncrl.listen import bound_ifname_env
    from local_engine.port_slot import claim_port, write_address

    listening = slot_lock = None  # the slot lock is held (open) for the process's life
    if settings.port_slots > 1 or settings.addr_file:
        try:  # claimed before the model loads: replicas starting together get distinct ports
            listening, slot_lock = claim_port(settings.host, settings.port, settings.port_slots, settings.slot_dir)
        except OSError as exc:
            print(f"asyncrl engine: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        settings = settings.model_copy(update={"port": listening.getsockname()[1]})
        if settings.addr_file:
            try:
                write_address(settings.addr_file, listening)
            except OSError as exc:
                print(f"asyncrl engine: cannot write --addr-file {settings.addr_file}: {exc.strerror or exc}", file=sys.stderr)
                return 2
    # an engine on its node's address (a cluster node) joins weight groups from that interface,
    # as docker/sglang/engine.sh sets for SGLang: gloo's default is the host name's address
    os.environ.update(bound_ifname_env(settings.host, os.environ))
    configure_logging(settings.log_level, json_lines=settings.log_json)
    import torch
    import uvicorn

    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    from asyncrl.models import ModelSpecError
    from local_engine.app import create_app

    try:
        app = create_app(settings)
    except (ModelSpecError, OSError, ValueError) as exc:  # bad spec, unreadable dir, unsupported model
        print(f"asyncrl engine: cannot load model {settings.model!r}: {exc}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, log_config=None,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, timeout_keep_alive=SERVER_KEEP_ALIVE_S, access_log=False))
    try:  # as uvicorn.run: Ctrl-C is a clean stop, a failed start-up exits non-zero
        server.run(sockets=[listening] if listening is not None else None)
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 3


if __name__ == "__main__":
    sys.exit(main())
