"""Admin routes: abort, pause/continue, flush, weight-update sessions and the weight updates
(own router, own key).

Weight routes answer ``{"success": bool, "message": str}`` — 200 on success, 400 on any
failure, never a 200 that hides one; a failed SGLang ``assert`` (dp_size on weight routes) is
a 500. ``/begin_weight_update`` and ``/end_weight_update`` exist only when the emulated
release has them (:mod:`local_engine.compat`): :data:`session_router`.
"""

from __future__ import annotations

import asyncio
import hashlib

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from asyncrl.sync_control.layout import parse_version
from local_engine.errors import JSONResp, parse_body, read_capped
from local_engine.protocol import (
    AbortBody,
    CheckWeightsBody,
    ContinueBody,
    DestroyGroupBody,
    InitGroupBody,
    PauseBody,
    SessionBody,
    SlowDownBody,
    UpdateDiskBody,
    UpdateDistributedBody,
    UpdateVersionBody,
)
from local_engine.routes_generate import EngineDep
from local_engine.weights import WeightUpdateError

router = APIRouter()
session_router = APIRouter()

FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def _result(ok: bool, message: str, **extra) -> JSONResp:
    return JSONResp({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)


@router.post("/abort_request")
async def abort_request(request: Request, engine: EngineDep) -> Response:
    body = await parse_body(request, AbortBody)
    engine.abort(rid=body.rid, abort_all=body.abort_all)
    return Response(status_code=200)


@router.post("/pause_generation")
async def pause_generation(request: Request, engine: EngineDep) -> Response:
    body = await parse_body(request, PauseBody)
    await engine.pause(body.mode)
    return JSONResp({"message": "Generation paused successfully.", "status": "ok"})


@router.api_route("/slow_down", methods=["GET", "POST"])
async def slow_down(request: Request, engine: EngineDep) -> Response:
    """SGLang's test hook (every release): each forward sleeps ``forward_sleep_time`` seconds
    until it is set to null. Answers ``null`` as SGLang's route (it returns nothing)."""
    body = await parse_body(request, SlowDownBody)
    engine.scheduler.forward_sleep_s = body.forward_sleep_time or None
    return JSONResp(None)


@router.post("/continue_generation")
async def continue_generation(request: Request, engine: EngineDep) -> Response:
    await parse_body(request, ContinueBody)
    await engine.resume()
    return JSONResp({"message": "Generation continued successfully.", "status": "ok"})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(engine: EngineDep, timeout: float = Query(0.0, ge=0.0)) -> Response:
    """SGLang's ``/flush_cache``: ``timeout`` > 0 waits for the engine to be idle (:mod:`local_engine.flush`)."""
    failure = await engine.cache_flush.flush(timeout)
    if failure is None:
        return Response(FLUSH_TEXT, status_code=200, media_type="text/plain")
    return Response(failure, status_code=400, media_type="text/plain")


async def _session_call(request: Request, call) -> Response:
    await parse_body(request, SessionBody)
    try:
        await call()
        return _result(True, "Success")
    except WeightUpdateError as exc:
        return _result(False, exc.message)


@session_router.post("/begin_weight_update")
async def begin_weight_update(request: Request, engine: EngineDep) -> Response:
    return await _session_call(request, engine.begin_session)


@session_router.post("/end_weight_update")
async def end_weight_update(request: Request, engine: EngineDep) -> Response:
    return await _session_call(request, engine.end_session)


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request, engine: EngineDep) -> Response:
    body = await parse_body(request, InitGroupBody)
    engine.check_dp("update weights from distributed")
    try:
        return _result(True, await engine.weights.init_group(body, pp_size=engine.settings.pp_size))
    except WeightUpdateError as exc:
        return _result(False, exc.message)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, engine: EngineDep) -> Response:
    body = await parse_body(request, DestroyGroupBody)
    engine.check_dp("destroy parameter update group")
    try:
        return _result(True, await engine.weights.destroy_group(body.group_name))
    except WeightUpdateError as exc:
        return _result(False, exc.message)


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request, engine: EngineDep) -> Response:
    body = await parse_body(request, UpdateDistributedBody)
    try:
        return _result(True, await engine.update_from_distributed(body))
    except WeightUpdateError as exc:
        return _result(False, exc.message)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, engine: EngineDep) -> Response:
    body = await parse_body(request, UpdateDiskBody)
    try:
        return _result(True, await engine.update_from_disk(body), num_paused_requests=0)
    except WeightUpdateError as exc:
        return _result(False, exc.message, num_paused_requests=0)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> Response:
    await read_capped(request)
    return _result(False, "update_weights_from_tensor needs CUDA IPC handles; local_engine does not support it")


@router.api_route("/weights_checker", methods=["GET", "POST"])
async def weights_checker(request: Request, engine: EngineDep) -> Response:
    """SGLang's checksum of every weight served (0.5.15+): one rank here. Its answer:
    ``ranks`` (per rank: ``checksums`` by name, ``per_gpu_checksum`` = SHA-256 over the sorted
    names and their checksums, ``parallelism_info``) and ``per_engine_checksum`` = SHA-256 over
    the ranks' ``per_gpu_checksum`` in order; 400 with ``success: false`` when the check fails."""
    body = await parse_body(request, CheckWeightsBody, optional=True)
    if body.action != "checksum":
        return _result(False, f"Unsupported action={body.action!r}")
    async with engine.rwlock.read():  # no update interleaves
        checksums = await asyncio.to_thread(engine.weights.tensor_hashes, body.skip_tensor_list, engine.compat.version)
    return _result(True, "Success.", **checksum_answer(checksums, parallelism_infos(engine.settings, engine.compat.version)))


def checksum_answer(checksums: dict[str, str], infos: list[dict]) -> dict:
    """``ranks`` (one SGLang ``ChecksumInfo`` per rank) and ``per_engine_checksum``."""
    per_gpu = overall_checksum(checksums)
    ranks = [{"checksums": checksums, "per_gpu_checksum": per_gpu, "parallelism_info": info} for info in infos]
    engine_sum = hashlib.sha256()
    for r in ranks:
        engine_sum.update(r["per_gpu_checksum"].encode())
    return {"ranks": ranks, "per_engine_checksum": engine_sum.hexdigest()}


def parallelism_infos(settings, release: str) -> list[dict]:
    """One ``parallelism_info`` per emulated rank (``tp_size × pp_size``; local_engine does not
    shard, so every rank reports the whole model's checksums); ``role`` from 0.5.21 on."""
    tp, pp = settings.tp_size, settings.pp_size
    infos = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            info = {"tp_rank": tp_rank, "tp_size": tp, "dp_rank": 0, "dp_size": settings.dp_size, "pp_rank": pp_rank,
                    "pp_size": pp, "rank": pp_rank * tp + tp_rank, "size": tp * pp}
            if parse_version(release) >= (0, 5, 21):
                info = {"role": "target", **info}
            infos.append(info)
    return infos


def overall_checksum(checksums: dict[str, str]) -> str:
    """SGLang's ``overall_checksum``: SHA-256 over each name and its checksum, names sorted."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


@router.post("/update_weight_version")
async def update_weight_version(request: Request, engine: EngineDep) -> Response:
    body = await parse_body(request, UpdateVersionBody)
    if body.abort_all_requests:
        engine.abort(abort_all=True)
    engine.set_version(body.new_version)
    return JSONResp({"success": True, "message": f"Weight version updated to {body.new_version}", "new_version": body.new_version})
