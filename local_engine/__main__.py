"""``asyncrl engine ...`` / ``python -m local_engine ...``: parse flags, build, serve.

    asyncrl engine --model builtin:tiny --host 127.0.0.1 --port 30000 \\
        [--dtype float32|bfloat16] [--seed 0] [--max-batch-size 32] [--max-model-len N] \\
        [--api-key K] [--admin-api-key K] [--weight-version default] \\
        [--sglang-compat 0.5.23] [--tp-size N] [--dp-size N] [--pp-size N] [--device cpu|cuda]

torch and transformers are imported only after the flags parsed (``--help`` is instant).
Keys can also come from ``$LOCAL_ENGINE_API_KEY`` / ``$LOCAL_ENGINE_ADMIN_API_KEY`` so they
stay out of ``ps`` output. SGLang's environment variables ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``
and ``SGLANG_HEALTH_CHECK_TIMEOUT`` are honoured as SGLang honours them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

GRACEFUL_SHUTDOWN_S = 5  # uvicorn waits this long for open requests after SIGTERM
KEEP_ALIVE_S = 30  # idle connection lifetime; above clients' pools (EngineClient: 3 s) so they close first
# One intra-op thread: with the trainer or other engines on the same cores, OpenMP's
# spinning made a tiny-model decode step 10x slower with 2 threads than with 1 (measured).
TORCH_THREADS = 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl engine", description="CPU inference engine speaking SGLang's HTTP protocol")
    p.add_argument("--model", default="builtin:tiny", help="builtin:tiny | builtin:smollm2-135m | HF model dir")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--api-key", default=os.environ.get("LOCAL_ENGINE_API_KEY"))
    p.add_argument("--admin-api-key", default=os.environ.get("LOCAL_ENGINE_ADMIN_API_KEY"))
    p.add_argument("--weight-version", default="default")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--weight-sync-timeout-s", type=float, default=300.0)
    p.add_argument("--torch-threads", type=int, default=TORCH_THREADS,
                   help="torch intra-op threads (default 1: on a shared 2-core box 2 threads ran 10x slower)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s = p.add_argument_group("SGLang fidelity (docs/local_engine.md)")
    s.add_argument("--sglang-compat", default=None, help="SGLang release to behave like (0.5.15-0.5.23, default 0.5.23)")
    s.add_argument("--tp-size", type=int, default=1, help="join weight-update groups as this many ranks (SGLang's TP workers)")
    s.add_argument("--dp-size", type=int, default=1, help="reported; weight updates refuse it like SGLang")
    s.add_argument("--pp-size", type=int, default=1, help="reported; weight-update groups refuse pp > 1")
    s.add_argument("--enable-dp-attention", action="store_true", help="reported (older SGLang allows dp > 1 with it)")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs")
    t = p.add_argument_group("timing mode (no model compute; for system benchmarks)")
    t.add_argument("--timing-mode", action="store_true", help="simulate decoding: sleep per step, long-tailed lengths")
    t.add_argument("--timing-decode-ms", type=float, default=20.0, help="latency of one batched decode step")
    t.add_argument("--timing-prefill-ms-per-token", type=float, default=0.05)
    t.add_argument("--timing-length-median", type=float, default=200.0, help="median response length (tokens)")
    t.add_argument("--timing-length-sigma", type=float, default=1.0, help="log-normal sigma: the tail's weight")
    t.add_argument("--timing-length-max", type=int, default=4096)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from pydantic import ValidationError

    from local_engine.settings import EngineSettings

    try:
        settings = EngineSettings(
            model=args.model, host=args.host, port=args.port, dtype=args.dtype, seed=args.seed,
            max_batch_size=args.max_batch_size, max_model_len=args.max_model_len, api_key=args.api_key or None,
            admin_api_key=args.admin_api_key or None, weight_version=args.weight_version,
            served_model_name=args.served_model_name, weight_sync_timeout_s=args.weight_sync_timeout_s,
            log_level=args.log_level, tp_size=args.tp_size, dp_size=args.dp_size, pp_size=args.pp_size,
            enable_dp_attention=args.enable_dp_attention, device=args.device,
            health_generation=os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1").lower() not in ("0", "false", "no"),
            health_check_timeout_s=os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"),
            **({"sglang_compat": args.sglang_compat} if args.sglang_compat else {}),
            timing=None if not args.timing_mode else {
                "decode_ms": args.timing_decode_ms, "prefill_ms_per_token": args.timing_prefill_ms_per_token,
                "length_median": args.timing_length_median, "length_sigma": args.timing_length_sigma,
                "length_max": args.timing_length_max, "seed": args.seed},
        )
    except ValidationError as exc:
        print(f"asyncrl engine: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    import uvicorn

    if args.torch_threads and args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    from asyncrl.models import ModelSpecError
    from local_engine.app import create_app

    try:
        app = create_app(settings)
    except (ModelSpecError, OSError, ValueError) as exc:  # bad spec, unreadable dir, unsupported model
        print(f"asyncrl engine: cannot load model {settings.model!r}: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, timeout_keep_alive=KEEP_ALIVE_S, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
