"""What the rollout service's engine client adds to a ``/generate`` call, per request.

    .venv/bin/python bench/proxy.py [--requests 400] [--prompt 256] [--new-tokens 1]

Starts ``python -m local_engine`` in timing mode (no model compute; decode and prefill take 0 ms)
on a free loopback port, then sends the same ``/generate`` call (``--prompt`` token ids,
``--new-tokens`` tokens, logprobs on) one at a time three ways, in turn so that all three see
the same background load:

- **direct**: a bare ``aiohttp`` POST of the same JSON body (the baseline: what any client pays);
- **EngineClient**: :class:`asyncrl.engine_client.EngineClient.generate` (JSON encoding,
  error mapping, response parsing into ``GenerateResult``);
- **EnginePool**: ``rollout_service.engines.pool.EnginePool.generate`` (what agents call:
  routing, rid bookkeeping, the lost-engine watch, per-call timeout, counters).

Prints p50 and p99 latency of each and the p50 each layer adds over direct. Goal (issue 13):
<= 2 ms p50 added. One request at a time: latency, not throughput (bench/wire.py and
bench/http_client.py cover encoding and client throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINE_START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 60.0
GOAL_MS = 2.0


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(url: str, n: int, prompt: int, new_tokens: int) -> dict[str, list[float]]:
    import aiohttp

    from asyncrl.engine_client import EngineClient
    from rollout_service.engines.pool import EnginePool

    ids = [(7 * k) % 500 + 3 for k in range(prompt)]
    sp = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    pool = EnginePool(control_timeout_s=CALL_TIMEOUT_S, request_timeout_s=CALL_TIMEOUT_S)
    pool.add(url)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8))
    client = EngineClient(url, request_timeout_s=CALL_TIMEOUT_S, control_timeout_s=CALL_TIMEOUT_S)

    async def direct() -> None:
        body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True, "rid": uuid.uuid4().hex}
        async with session.post(f"{url}/generate", json=body) as r:
            assert r.status == 200, r.status
            out = await r.json()
            assert len(out["output_ids"]) == new_tokens

    async def via_client() -> None:
        res = await client.generate(ids, sp)
        assert len(res.output_ids) == new_tokens

    async def via_pool() -> None:
        res = await pool.generate(None, ids, sp, rid=f"bench-{uuid.uuid4().hex}")
        assert len(res.output_ids) == new_tokens

    ways = {"direct": direct, "EngineClient": via_client, "EnginePool": via_pool}
    times: dict[str, list[float]] = {k: [] for k in ways}
    try:
        for fn in ways.values():  # warm-up: connections, first-call paths
            for _ in range(20):
                await fn()
        for _ in range(n):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                await fn()
                times[name].append((time.perf_counter() - t0) * 1000)
    finally:
        await session.close()
        await client.close()
        await pool.close()
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="timed calls per way")
    p.add_argument("--prompt", type=int, default=256, help="prompt token ids per call")
    p.add_argument("--new-tokens", type=int, default=1)
    args = p.parse_args(argv)
    from asyncrl.launch import ChildProcess, free_port, http_ok

    print("$ " + shlex.join([".venv/bin/python", "bench/proxy.py", *(sys.argv[1:] if argv is None else argv)]), flush=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "local_engine", "--model", "builtin:tiny", "--port", str(port), "--timing-mode",
           "--timing-decode-ms", "0", "--timing-prefill-ms-per-token", "0", "--log-level", "warning"]
    with ChildProcess("engine", cmd, ROOT / "runs" / "bench" / f"proxy-engine-{port}.log", cwd=ROOT) as engine:
        engine.wait_ready(lambda: http_ok(f"{url}/health"), ENGINE_START_TIMEOUT_S)
        times = asyncio.run(measure(url, args.requests, args.prompt, args.new_tokens))
    base = statistics.median(times["direct"])
    print(f"/generate, {args.prompt} prompt ids, {args.new_tokens} new token(s), one call at a time, "
          f"{args.requests} calls per way (interleaved); local_engine timing mode")
    worst = 0.0
    for name, xs in times.items():
        p50 = statistics.median(xs)
        added = p50 - base
        worst = max(worst, added)
        print(f"  {name:13s} p50 {p50:6.2f} ms  p99 {pct(xs, 0.99):6.2f} ms"
              + ("" if name == "direct" else f"  added p50 {added:+.2f} ms"))
    print(f"goal: <= {GOAL_MS:g} ms p50 added: {'met' if worst <= GOAL_MS else 'NOT met'} (largest {worst:+.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
