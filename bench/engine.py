"""Generated tokens/s of a real local_engine at concurrency 1 and 16, and their ratio.

    .venv/bin/python bench/engine.py [--model builtin:tiny] [--dtype float32] \\
        [--new-tokens 64] [--rounds 2] [--min-ratio 4]

Starts ``python -m local_engine`` on a free loopback port, warms it up, then measures
(a) requests one after another and (b) 16 requests at once, each sampling exactly
``--new-tokens`` tokens (``ignore_eos``, temperature 1) after a ~16-token prompt, through
:class:`asyncrl.engine_client.EngineClient`. Prints the command, both rates and the ratio;
exits 1 if the ratio is below ``--min-ratio`` (batching should give >= 4x).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINE_START_TIMEOUT_S = 600.0  # first use of builtin:smollm2-135m converts a GGUF (~15 s, more on a busy box)
REQUEST_TIMEOUT_S = 900.0


async def measure(url: str, concurrency: int, rounds: int, new_tokens: int) -> tuple[float, int, float]:
    from asyncrl.engine_client import EngineClient

    sp = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    async with EngineClient(url, request_timeout_s=REQUEST_TIMEOUT_S) as c:
        await asyncio.gather(*(c.generate(list(range(3, 19)), {**sp, "max_new_tokens": 8}) for _ in range(concurrency)))
        started = time.perf_counter()
        tokens = 0
        for r in range(rounds):
            results = await asyncio.gather(*(c.generate([(7 * i + 3 * r + k) % 500 + 3 for k in range(16)], sp) for i in range(concurrency)))
            tokens += sum(len(x.output_ids) for x in results)
        elapsed = time.perf_counter() - started
    return tokens / elapsed, tokens, elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="batches of requests per measurement")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--min-ratio", type=float, default=4.0)
    args = p.parse_args(argv)
    from asyncrl.launch import ChildProcess, free_port, http_ok

    print("$ " + shlex.join([".venv/bin/python", "bench/engine.py", *(sys.argv[1:] if argv is None else argv)]), flush=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "local_engine", "--model", args.model, "--dtype", args.dtype, "--port", str(port),
           "--torch-threads", str(args.torch_threads), "--max-batch-size", str(max(32, args.concurrency)), "--log-level", "warning"]
    with ChildProcess("engine", cmd, Path("/tmp") / f"bench-engine-{port}.log", cwd=ROOT) as engine:
        engine.wait_ready(lambda: http_ok(f"{url}/health"), ENGINE_START_TIMEOUT_S)
        single = asyncio.run(measure(url, 1, args.rounds * 2, args.new_tokens))
        batched = asyncio.run(measure(url, args.concurrency, args.rounds, args.new_tokens))
    ratio = batched[0] / single[0]
    print(f"model {args.model} ({args.dtype}), {args.new_tokens} new tokens per request, torch threads {args.torch_threads}")
    print(f"concurrency  1: {single[0]:8.1f} tok/s  ({single[1]} tokens in {single[2]:.2f} s)")
    print(f"concurrency {args.concurrency:2d}: {batched[0]:8.1f} tok/s  ({batched[1]} tokens in {batched[2]:.2f} s)")
    print(f"ratio: {ratio:.2f}x (min {args.min_ratio:g}x)")
    return 0 if ratio >= args.min_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
