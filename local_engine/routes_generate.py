"""Data-plane routes: ``/generate`` (POST, PUT; JSON or SSE) and the health probes.

``/generate`` takes one request (``text`` or ``input_ids``); batches and ``n>1`` are
refused with 400. Non-streaming calls are watched for client disconnects (polled every
``DISCONNECT_POLL_S``); a vanished client aborts its request. Streaming answers are
cumulative SSE chunks ending with ``data: [DONE]``; an error after the stream started is
sent as ``data: {"error": {...}}``.

``/health``: 200 while the scheduler runs and the weights are consistent, else 503 (cheap;
for load balancers). ``/health_generate``: additionally generates one token when the
engine is idle and not paused (bounded by ``HEALTH_GENERATE_TIMEOUT_S``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response, StreamingResponse

from local_engine.engine import Engine
from local_engine.errors import JSONResp, Refused, parse_body
from local_engine.protocol import GenerateBody, SamplingParams
from local_engine.request import Req

DISCONNECT_POLL_S = 1.0  # how often a waiting /generate checks that its client is still there
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT

router = APIRouter()


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(get_engine)]


async def _until_done_or_disconnect(request: Request, engine: Engine, req: Req) -> dict | None:
    task = asyncio.ensure_future(engine.generate(req))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                engine.cancel(req, "client disconnected")
                task.cancel()
                return None
    except asyncio.CancelledError:
        engine.cancel(req, "request cancelled")
        task.cancel()
        raise


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _stream(engine: Engine, req: Req) -> AsyncIterator[bytes]:
    try:
        async with engine.generation_slot():
            engine.submit(req)
            while True:
                await req.updated.wait()
                req.updated.clear()
                yield _sse(engine.render(req))
                if req.finished:
                    break
        engine.metrics.finished.labels(reason=(req.finish_reason or {}).get("type", "unknown")).inc()
    except Refused as exc:
        yield _sse({"error": {"message": exc.message, "type": "invalid_request_error", "code": exc.status, "retryable": exc.status >= 500}})
    finally:
        engine.cancel(req, "client disconnected")
    yield b"data: [DONE]\n\n"


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request, engine: EngineDep) -> Response:
    body = await parse_body(request, GenerateBody)
    req = engine.build_request(body)
    if req.stream:
        engine.check_serving()
        return StreamingResponse(_stream(engine, req), media_type="text/event-stream")
    out = await _until_done_or_disconnect(request, engine, req)
    if out is None:
        return JSONResp({"error": {"message": "client disconnected"}}, status_code=499)
    return JSONResp(out)


@router.get("/health")
async def health(engine: EngineDep) -> Response:
    if not engine.scheduler.alive:
        return JSONResp({"error": {"message": "scheduler is not running"}}, status_code=503)
    if not engine.weights.consistent:
        return JSONResp({"error": {"message": f"weights are inconsistent: {engine.weights.inconsistent_reason}"}}, status_code=503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(engine: EngineDep) -> Response:
    basic = await health(engine)
    if basic.status_code != 200 or engine.gate.paused or engine.scheduler.running:
        return basic  # paused on purpose, or already making progress
    req = Req(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt_ids=[0],
              params=SamplingParams(max_new_tokens=1, temperature=0.0))
    try:
        await asyncio.wait_for(engine.generate(req), HEALTH_GENERATE_TIMEOUT_S)
    except (TimeoutError, Refused):
        engine.cancel(req, "health check timed out")
        return JSONResp({"error": {"message": "health generation did not finish"}}, status_code=503)
    return Response(status_code=200)
