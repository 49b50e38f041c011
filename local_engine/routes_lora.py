"""LoRA adapter routes (SGLang's, admin level): ``/load_lora_adapter``,
``/load_lora_adapter_from_tensors``, ``/unload_lora_adapter``.

Bodies are SGLang's ``LoadLoRAAdapterReqInput``, ``LoadLoRAAdapterFromTensorsReqInput`` and
``UnloadLoRAAdapterReqInput`` of the emulated release (``tests/contract/test_lora_contract.py``
checks the fields against every wheel): the tensors come as ``serialized_tensors`` (one
base64 string every rank reads) up to 0.5.16 and as ``serialized_named_tensors`` (one base64
string per TP rank: rank r reads entry r) from 0.5.17; ``expected_checksums`` (0.5.16+) are
sha256 of each tensor's bytes, checked by every rank before anything is loaded (SGLang's
"[LORA-CHECK]" message). Each emulated rank (``--tp-size``) decodes and checks its own entry.

The payload is a pickle of a dict name → CPU tensor, read by a restricted unpickler like
SGLang's ``SafeUnpickler``: tensors, storages and dtypes only, and (stricter than SGLang, issue
48) never torch's own functions: ``find_class`` returns stand-ins, the opcodes that set
attributes or build other objects (BUILD, INST, OBJ, NEWOBJ, ...) are refused before anything is
unpickled, and each tensor must be a float, dense, contiguous, finite tensor covering its own
storage (``tensor_problem``); an unreadable payload (a declared length the bytes do not hold, a
recursion) is a 400, never a 500. Every release 0.5.15-0.5.23
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

import base64
import binascii
import codecs
import io
import pickle
import pickletools
from collections import OrderedDict
from typing import Any

import torch
from fastapi import APIRouter, Request
from pydantic import Field
from starlette.responses import Response

from asyncrl.sync_control.layout import parse_version
from local_engine.errors import BadRequest, JSONResp, parse_body
from local_engine.lora import TENSOR_PATH, sha256_of
from local_engine.protocol import _Body
from local_engine.routes_generate import EngineDep

router = APIRouter()

MAX_ADAPTER_BODY_BYTES = 1 << 30
"""Largest ``/load_lora_adapter_from_tensors`` body (SGLang sets none): a rank-64 adapter on
every linear layer of a 7B model is ~0.6 GB as base64 fp32."""
_SAFE_GLOBALS = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
                 ("collections", "OrderedDict"), ("torch", "Size")}
_SAFE_GLOBALS |= {("torch", n) for n in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")}


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


_REFUSED_OPCODES = frozenset({"BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4"})
"""Opcodes a dict of tensors never needs: BUILD would set attributes on what ``find_class``
returned (a payload once re-programmed torch's ``_rebuild_tensor_v2`` for every later load:
issue 48), the others build arbitrary objects."""
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MAX_ADAPTER_TENSORS = 100_000


def _check_opcodes(raw: bytes) -> None:
    """Refuse a payload using an opcode outside a plain pickle of tensors, or declaring more
    bytes than it holds (before anything is allocated)."""
    try:
        for op, _arg, _pos in pickletools.genops(raw):
            if op.name in _REFUSED_OPCODES:
                raise ValueError(f"the serialized tensors use the pickle opcode {op.name}, which a dict of tensors never needs")
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - genops raises what the bytes make it: all mean "not a pickle"
        raise ValueError(f"the serialized tensors are not a pickle: {type(exc).__name__}: {exc}") from None


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """A fresh stand-in for ``torch._utils._rebuild_tensor_v2`` (never the function itself, so
    nothing in a payload can change torch): checks the arguments' types first."""
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError("a tensor's storage is not a torch storage")
    if not (isinstance(storage_offset, int) and isinstance(size, tuple | torch.Size) and isinstance(stride, tuple)
            and all(isinstance(x, int) and x >= 0 for x in (*size, *stride))):
        raise pickle.UnpicklingError("a tensor's offset, size or stride is not a tuple of non-negative ints")
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, torch.Size(size), stride, False, OrderedDict())


def _unpickler(data: bytes, old_protocols: bool) -> pickle.Unpickler:
    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if (module, name) == ("torch.storage", "_load_from_bytes"):
                return _load_storage
            if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor")):
                return _rebuild_tensor
            if (module, name) == ("collections", "OrderedDict"):
                return OrderedDict
            if (module, name) == ("torch", "Size"):
                return torch.Size
            if module == "torch" and name in _DTYPE_NAMES:
                return getattr(torch, name)
            if (module, name) == ("_codecs", "encode") and old_protocols:
                return codecs.encode
            raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")

    return Restricted(io.BytesIO(data))


_DTYPE_NAMES = frozenset({"float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool"})


def _load_storage(data: bytes):
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    return storage


def tensor_problem(name: str, t: torch.Tensor) -> str | None:
    """Why a decoded adapter tensor cannot be loaded, or None: a float dtype, a plain dense
    tensor (no negative or conjugate bit), contiguous and covering its whole storage (no
    stride-0 or offset views into a larger buffer), finite."""
    if t.dtype not in _DTYPES:
        return f"tensor {name}: dtype {t.dtype} is not a float type"
    if t.is_neg() or t.is_conj() or t.layout != torch.strided or t.is_quantized:
        return f"tensor {name}: not a plain dense tensor"
    if not t.is_contiguous() or t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return f"tensor {name}: must be contiguous and cover its whole storage"
    if not bool(torch.isfinite(t).all()):
        return f"tensor {name}: holds NaN or infinite values"
    return None


def decode_tensors(payload: str, old_protocols: bool) -> dict[str, torch.Tensor]:
    """One rank's payload as name → tensor (``old_protocols``: pickle protocol 2 and older
    admitted, 0.5.21+); raises ValueError (bad base64, bad pickle, refused opcodes, not a dict
    of tensors, a tensor :func:`tensor_problem` refuses) or RuntimeError (a blocked global)."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the serialized tensors are not base64: {exc}") from None
    _check_opcodes(raw)
    try:
        data = _unpickler(raw, old_protocols).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError, KeyError,
            MemoryError, OverflowError, RecursionError) as exc:
        raise ValueError(f"the serialized tensors are not a pickle of tensors: {type(exc).__name__}: {exc}") from None
    if isinstance(data, list):
        try:
            data = dict(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the serialized tensors must be a dict of name to tensor: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()):
        raise ValueError("the serialized tensors must be a dict of name to tensor")
    if len(data) > MAX_ADAPTER_TENSORS:
        raise ValueError(f"the serialized tensors hold {len(data)} tensors (at most {MAX_ADAPTER_TENSORS})")
    for name, t in data.items():
        problem = tensor_problem(name, t)
        if problem:
            raise ValueError(problem)
    return data


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
            tensors = decode_tensors(payload, old_protocols=release >= (0, 5, 21))
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
