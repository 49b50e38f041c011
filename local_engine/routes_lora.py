"""LoRA adapter routes (SGLang's, admin level): ``/load_lora_adapter``,
``/load_lora_adapter_from_tensors``, ``/unload_lora_adapter``.

Bodies are SGLang's ``LoadLoRAAdapterReqInput``, ``LoadLoRAAdapterFromTensorsReqInput`` and
``UnloadLoRAAdapterReqInput`` of the emulated release (``tests/contract/test_lora_contract.py``
checks the fields against every wheel): the tensors come as ``serialized_tensors`` (one
base64 string every rank reads) up to 0.5.16 and as ``serialized_named_tensors`` (one base64
string per TP rank: rank r reads entry r) from 0.5.17; ``expected_checksums`` (0.5.16+) are
sha256 of each tensor's bytes, checked by every rank before anything is loaded (SGLang's
"[LORA-CHECK]" message). Each emulated rank (``--tp-size``) decodes and checks its own entry.

The payload (a pickle of a dict name → CPU tensor) is decoded without trusting it, in a worker
thread, by :mod:`local_engine.adapter_payload`; an unreadable or hostile one is a 400. Every release 0.5.15-0.5.23
admits a plain pickle of CPU tensors (protocol 3 or later; their own unpicklers were run on
it: tests/contract); protocol 2 and older reach for ``_codecs.encode``, blocked before 0.5.21
("Blocked unsafe global ... during pickle deserialization"). Shared-memory handles (same-host
``ForkingPickler`` payloads) and ``load_format`` ``flattened_bucket`` are refused here.

In SGLang, decoding, unpickling, a rank's entry missing from a short list and a checksum
mismatch all raise in the scheduler, outside the LoRA manager's error handling, and the server
exits: with ``--sglang-fatal-errors`` local_engine exits too; without, it answers 400 naming the
problem. Every other answer is ``LoRAUpdateOutput``, 200 on success and 400 otherwise
(:mod:`local_engine.lora`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from fastapi import APIRouter, Request
from pydantic import Field
from starlette.responses import Response

from asyncrl.sync_control.layout import parse_version
from local_engine.adapter_payload import decode_tensors
from local_engine.errors import BadRequest, JSONResp, parse_body
from local_engine.lora import TENSOR_PATH, sha256_of
from local_engine.protocol import _Body
from local_engine.routes_generate import EngineDep

router = APIRouter()

MAX_ADAPTER_BODY_BYTES = 1 << 30
"""Largest ``/load_lora_adapter_from_tensors`` body (SGLang sets none): a rank-64 adapter on
every linear layer of a 7B model is ~0.6 GB as base64 fp32."""


class LoadLoraBody(_Body):
    NULL_REFUSED = frozenset({"lora_name", "lora_path", "pinned"})
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class UnloadLoraBody(_Body):
    NULL_REFUSED = frozenset({"lora_name"})
    lora_name: str
    lora_id: str | None = None


class LoadLoraTensorsBody(_Body):
    NULL_REFUSED = frozenset({"lora_name", "config_dict", "pinned", "serialized_tensors", "serialized_named_tensors"})
    lora_name: str
    config_dict: dict[str, Any]
    # each release requires one of the two (0.5.15-0.5.16, then 0.5.17+): absent here is None,
    # null is refused as there
    serialized_tensors: str = Field(None, validate_default=False)
    serialized_named_tensors: list[str] = Field(None, validate_default=False)
    pinned: bool = False
    added_tokens_config: dict[str, Any] | None = None
    lora_id: str | None = None
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None


def _answer(out: dict) -> JSONResp:
    return JSONResp(out, status_code=200 if out["success"] else 400)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, engine: EngineDep) -> Response:
    body = await parse_body(request, LoadLoraBody)
    if engine.lora.enabled:
        engine.check_lora_dp()
    return _answer(await engine.lora.load(body.lora_name, body.lora_path, body.pinned))


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, engine: EngineDep) -> Response:
    body = await parse_body(request, UnloadLoraBody)
    if engine.lora.enabled:
        engine.check_lora_dp()
    return _answer(await engine.lora.unload(body.lora_name))


@router.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(request: Request, engine: EngineDep) -> Response:
    body = await parse_body(request, LoadLoraTensorsBody, limit=MAX_ADAPTER_BODY_BYTES)
    if engine.lora.enabled:
        engine.check_lora_dp()  # before the tensors are decoded, as SGLang's tokenizer manager asserts first
    release = parse_version(engine.compat.version)
    named = release >= (0, 5, 17)
    tp = engine.settings.tp_size
    if named and body.serialized_named_tensors:
        payloads = body.serialized_named_tensors
        if len(payloads) < tp:  # rank len(payloads) raises IndexError, uncaught: SGLang's server exits
            why = (f"serialized_named_tensors has {len(payloads)} entries for {tp} TP ranks: rank {len(payloads)} "
                   "raises IndexError (SGLang's server exits on it)")
            engine.fatal_if_sglang_would_die(why)
            raise BadRequest(why)
        payloads = payloads[:tp]
    elif not named and body.serialized_tensors is not None:
        payloads = [body.serialized_tensors] * tp
    else:
        field = "serialized_named_tensors" if named else "serialized_tensors"
        raise BadRequest(f"{field}: Field required (sglang {engine.compat.version} takes the adapter's tensors there)")
    if not engine.lora.enabled:
        return _answer(engine.lora.output(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", listed=False))
    if body.load_format is not None:
        return _answer(engine.lora.output(False, f"load_format {body.load_format!r} is not supported by local_engine "
                                                 "(send a dict of tensors)"))
    expected = body.expected_checksums if release >= (0, 5, 16) else None
    ranks = []
    for rank, payload in enumerate(payloads):
        try:
            tensors = await asyncio.to_thread(decode_tensors, payload, release >= (0, 5, 21), engine.lora.max_adapter_bytes())
        except (ValueError, RuntimeError) as exc:
            engine.fatal_if_sglang_would_die(f"rank {rank}: {exc}")
            return _answer(engine.lora.output(False, str(exc)))
        try:
            problem = _checksum_problem(rank, tensors, expected) if expected is not None else None
        except (TypeError, ValueError, RuntimeError) as exc:  # e.g. a checksum that is not a string
            problem = f"[LORA-CHECK] rank{rank}: the checksums could not be compared: {exc}"
        if problem:
            engine.fatal_if_sglang_would_die(problem)
            return _answer(engine.lora.output(False, problem))
        ranks.append(tensors)
    # local_engine does not shard: every rank holds the whole adapter; rank 0's copy is served
    return _answer(await engine.lora.load(body.lora_name, TENSOR_PATH, body.pinned, body.config_dict, ranks[0]))


def _checksum_problem(rank: int, tensors: dict[str, torch.Tensor], expected: dict[str, str]) -> str | None:
    mismatch = [n for n, want in expected.items() if n in tensors and sha256_of(tensors[n]) != want]
    missing = [n for n in expected if n not in tensors]
    extra = [n for n in tensors if n not in expected]
    if not (mismatch or missing or extra):
        return None
    return (f"[LORA-CHECK] rank{rank} adapter sync MISMATCH of {len(expected)} expected: {len(mismatch)} value-diff "
            f"{mismatch[:5]}, {len(missing)} missing {missing[:5]}, {len(extra)} extra {extra[:5]}")
