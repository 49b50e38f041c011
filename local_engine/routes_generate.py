"""Data-plane routes: ``/generate`` (POST, PUT; JSON or SSE) and the health probes.

``/generate`` takes one request (``text`` or ``input_ids``); batches and ``n>1`` are
refused with 400. A non-streamed request that ends with an abort carrying status 400, 500 or
503 (a sampling support over ``--sampling-mask-max-tokens``, an engine failure) is answered with
that HTTP status, as SGLang does. Non-streaming calls are watched for client disconnects (polled every
``DISCONNECT_POLL_S``); a vanished client aborts its request. Streaming answers are
cumulative SSE chunks ending with ``data: [DONE]``; an error after the stream started is
sent as ``data: {"error": {...}}``.

``/health_generate`` (SGLang's semantics): 200 once the engine shows progress — requests
running, or one generated token when idle — else 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT``
(20 s); it waits behind a pause, so a paused engine answers 503 after 20 s. ``/health`` is the
same unless ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``, then 200 while the scheduler runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated

import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response, StreamingResponse

from local_engine.engine import Engine
from local_engine.errors import JSONResp, Refused, http_error, parse_body, refused_response
from local_engine.protocol import GenerateBody
from local_engine.request import Req

DISCONNECT_POLL_S = 1.0  # how often a waiting /generate checks that its client is still there

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
        with engine.tracked(req):
            async with engine.generation_slot(req):
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
        return StreamingResponse(_stream(engine, req), media_type="text/event-stream")
    out = await _until_done_or_disconnect(request, engine, req)
    if out is None:
        return JSONResp({"error": {"message": "client disconnected"}}, status_code=499)
    return _abort_as_error(out) or JSONResp(out)


def _abort_as_error(out: dict) -> Response | None:
    """SGLang's tokenizer (every supported release) turns a non-streamed request that ended
    with an abort carrying status 400 into a 400 answer (a ``ValueError``), and one with 500
    or 503 into that HTTP error; a streamed one ends with the abort chunk instead."""
    reason = out["meta_info"].get("finish_reason") or {}
    status = reason.get("status_code")
    if reason.get("type") != "abort" or status not in (400, 500, 503):
        return None
    return refused_response(reason["message"]) if status == 400 else http_error(status, reason["message"])


@router.get("/health")
async def health(engine: EngineDep) -> Response:
    if engine.settings.health_generation:
        return await health_generate(engine)
    return Response(status_code=200 if engine.scheduler.alive else 503)


@router.get("/health_generate")
async def health_generate(engine: EngineDep) -> Response:
    return Response(status_code=200 if await engine.health_generate() else 503)
