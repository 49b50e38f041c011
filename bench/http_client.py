"""Which async HTTP client should talk to engines? aiohttp vs httpx, measured.

    .venv/bin/python bench/http_client.py [--requests 4000] [--concurrency 64]

Starts a trivial FastAPI app under uvicorn (one worker, a child process on 127.0.0.1),
then sends the same number of small JSON POSTs at the same concurrency with
``aiohttp.ClientSession`` and with ``httpx.AsyncClient`` (one client each, connection pool
sized to the concurrency), and prints requests per second for both. The engine client
uses whichever wins (aiohttp; see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from pathlib import Path

SERVER_START_TIMEOUT_S = 60.0


def serve(port: int) -> None:
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return {"ok": True, "n": len(body)}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def run_aiohttp(url: str, n: int, concurrency: int) -> float:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def one(i: int) -> None:
            async with sem, s.post(url, json={"i": i, "input_ids": [1, 2, 3]}) as r:
                assert r.status == 200
                await r.read()

        await one(-1)
        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t)


async def run_httpx(url: str, n: int, concurrency: int) -> float:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as c:

        async def one(i: int) -> None:
            async with sem:
                r = await c.post(url, json={"i": i, "input_ids": [1, 2, 3]})
                assert r.status_code == 200

        await one(-1)
        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from asyncrl.launch import ChildProcess, free_port, port_open

    print("$ " + shlex.join([".venv/bin/python", "bench/http_client.py", *sys.argv[1:]]))
    port = free_port()
    server = ChildProcess("echo-server", [sys.executable, __file__, "--serve", str(port)], Path("/tmp") / f"bench-http-{port}.log")
    with server:
        server.wait_ready(lambda: port_open("127.0.0.1", port), SERVER_START_TIMEOUT_S)
        url = f"http://127.0.0.1:{port}/echo"
        aio = asyncio.run(run_aiohttp(url, args.requests, args.concurrency))
        hx = asyncio.run(run_httpx(url, max(200, args.requests // 8), args.concurrency))
    print(f"server: FastAPI + uvicorn (1 worker); {args.requests} POSTs (httpx: {max(200, args.requests // 8)}), concurrency {args.concurrency}")
    print(f"aiohttp {aio:8.0f} req/s")
    print(f"httpx   {hx:8.0f} req/s")
    print(f"aiohttp/httpx {aio / hx:5.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
