"""Read-only routes: model/server info, loads, Prometheus metrics, OpenAI model list.

Never exposes ``api_key`` / ``admin_api_key`` (sglang #30166 leaked them via /server_info).
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from fastapi import APIRouter
from starlette.responses import Response

import local_engine
from local_engine.engine import Engine
from local_engine.errors import JSONResp
from local_engine.routes_generate import EngineDep

router = APIRouter()

SECRET_SETTINGS = frozenset({"api_key", "admin_api_key"})


def model_info(engine: Engine) -> dict:
    cfg = engine.config
    serving = {  # 0.5.21+ (compat.model_info_serving)
        "served_model_name": engine.settings.served_model_name or engine.settings.model, "load_format": "auto",
        "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
    } if engine.compat.model_info_serving else {}
    return {
        "model_path": engine.settings.model,
        "tokenizer_path": engine.settings.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weights.version,
        **serving,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None),
        "architectures": getattr(cfg, "architectures", None),
    }


def internal_state(engine: Engine) -> dict:
    s = engine.scheduler
    return {
        "num_running_reqs": len(s.running),
        "num_waiting_reqs": len(s.waiting),
        "last_decode_batch_size": s.last_decode_batch,
        "max_decode_batch_size": s.max_decode_batch,
        "steps": s.steps,
        "paused": engine.gate.paused,
        "pause_mode": engine.gate.mode,
        "weight_update_groups": sorted(engine.weights.groups),
        "weight_update_session": engine.session_open,
        "generations_in_flight": engine.rwlock.readers,
        "weight_writers_waiting": engine.rwlock.writers_waiting,
    }


def _loads(engine: Engine) -> dict:
    s = engine.scheduler
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": local_engine.__version__,
        "accelerator": "cpu",
        "num_accelerators": 0,
        "loads": [{"dp_rank": 0, "num_running_reqs": len(s.running), "num_waiting_reqs": len(s.waiting),
                   "num_total_tokens": sum(len(r.prompt_ids) + len(r.output_ids) for r in s.running)}],
    }


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(engine: EngineDep) -> Response:
    return JSONResp(model_info(engine))


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(engine: EngineDep) -> Response:
    hidden = SECRET_SETTINGS | (set() if engine.compat.sampling_mask_cap else {"sampling_mask_max_tokens"})  # 0.5.20+
    settings = {k: v for k, v in engine.settings.model_dump().items() if k not in hidden}
    return JSONResp({
        **settings,
        "model_path": engine.settings.model,
        "served_model_name": engine.settings.served_model_name or engine.settings.model,
        "tp_size": engine.settings.tp_size,
        "dp_size": engine.settings.dp_size,
        "pp_size": engine.settings.pp_size,
        "enable_dp_attention": engine.settings.enable_dp_attention,
        "enable_hierarchical_cache": False,  # not emulated: the routes of a host-cached prefix (issue 66 N4)
        "weight_version": engine.weights.version,
        "enable_lora": engine.lora.enabled,
        "max_lora_rank": engine.lora.max_rank or None,
        "max_loaded_loras": engine.settings.max_loaded_loras,
        "max_loras_per_batch": engine.settings.max_loras_per_batch,
        "lora_target_modules": engine.lora.target_modules,
        "max_total_num_tokens": engine.settings.max_batch_size * engine.max_model_len,
        "max_req_input_len": engine.max_model_len - 1,
        "context_length": engine.max_model_len,
        "vocab_size": engine.vocab_size,
        "uptime_s": time.time() - engine.started_at,
        "internal_states": [internal_state(engine)],
        "version": engine.compat.version,
        "engine": "local_engine",
        "engine_version": local_engine.__version__,
        **({"nccl_version": _nccl_version()} if engine.settings.device == "cuda" else {}),
    })


def _nccl_version() -> str | None:
    """This process's NCCL as ``"2.27.5"`` (SGLang reports none; see asyncrl.sync_control.layout)."""
    import torch

    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CUDA build without NCCL
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


@router.get("/v1/loads")
async def get_loads(engine: EngineDep) -> Response:
    return JSONResp(_loads(engine))


@router.get("/get_load")
async def get_load(engine: EngineDep) -> Response:
    """Up to 0.5.20 only (``compat.legacy_routes``): one load per DP rank, in its own shape (not
    ``/v1/loads``'); 0.5.21 removed it."""
    if not engine.compat.legacy_routes:
        return JSONResp({"detail": "Not Found"}, status_code=404)
    s = engine.scheduler
    tokens = sum(len(r.prompt_ids) + len(r.output_ids) for r in s.running)
    return JSONResp([{"dp_rank": 0, "num_reqs": len(s.running) + len(s.waiting), "num_waiting_reqs": len(s.waiting),
                      "num_tokens": tokens, "num_pending_tokens": sum(len(r.prompt_ids) for r in s.waiting),
                      "ts_tic": time.time()}])


@router.get("/metrics")
async def metrics(engine: EngineDep) -> Response:
    s = engine.scheduler
    engine.metrics.running.set(len(s.running))
    engine.metrics.waiting.set(len(s.waiting))
    return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def list_models(engine: EngineDep) -> Response:
    name = engine.settings.served_model_name or engine.settings.model
    card = {"id": name, "object": "model", "created": int(engine.started_at), "owned_by": "sglang", "root": name,
            "max_model_len": engine.max_model_len}
    adapters = [{"id": a.name, "object": "model", "created": int(engine.started_at), "owned_by": "sglang", "root": a.path,
                 "parent": name, "max_model_len": None} for a in engine.lora.registry.values()]
    return JSONResp({"object": "list", "data": [card, *adapters]})


@router.get("/weights_checksum")
async def weights_checksum(engine: EngineDep) -> Response:
    """local_engine only (SGLang has no such route): the checksum of the weights it serves and
    their version, read under the weights lock so no update interleaves."""
    async with engine.rwlock.read():
        version = engine.weights.version
        checksum = await asyncio.to_thread(engine.weights.checksum)
    return JSONResp({"weight_version": version, "checksum": checksum, "parameters": engine.weights.parameter_count})


@router.get("/get_weight_version")
@router.get("/weight_version")
async def deprecated_weight_version(engine: EngineDep) -> Response:
    """Deprecated up to 0.5.20 (a 404 saying so, ``compat.legacy_routes``), removed from 0.5.21
    (FastAPI's 404): the version is ``/model_info``'s ``weight_version``."""
    if engine.compat.legacy_routes:
        return JSONResp({"object": "error", "message": "Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
                         "Please use '/model_info' instead.", "type": "404", "param": None, "code": 404}, status_code=404)
    return JSONResp({"detail": "Not Found"}, status_code=404)
