"""The adapter tensors of ``/load_lora_adapter_from_tensors``: one rank's base64 payload decoded
into name → tensor without trusting it (issues 48 and 67 L1).

The payload is a pickle of a dict name → CPU tensor, read by a restricted unpickler like
SGLang's ``SafeUnpickler``: tensors, storages and dtypes only, and (stricter than SGLang, issue
48) never torch's own functions: ``find_class`` returns stand-ins, the opcodes that set
attributes or build other objects (BUILD, INST, OBJ, NEWOBJ, ...) are refused before anything is
unpickled, and each tensor must be a float, dense, contiguous, finite tensor covering its own
storage (:func:`tensor_problem`). Nothing is allocated beyond what the payload carries (issue 67
L1): each storage's record (torch's legacy format) is read first, its declared size must be
present in the payload, and all storages together must fit the largest adapter the engine could
serve. An unreadable payload (a declared length the bytes do not hold, a recursion) is a
ValueError, which the route answers as a 400, never a 500.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import io
import pickle
import pickletools
from collections import OrderedDict

import torch

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


class _Budget:
    """Bytes the storages of one payload may still declare (None: no model bound)."""

    def __init__(self, limit: int | None) -> None:
        self.left = limit

    def take(self, nbytes: int) -> None:
        if self.left is None:
            return
        if nbytes > self.left:
            raise pickle.UnpicklingError(f"the adapter's storages declare more bytes than an adapter of --max-lora-rank "
                                         f"on this model's --lora-target-modules can hold ({nbytes} more, "
                                         f"{self.left} left)")
        self.left -= nbytes


_STORAGE_ITEMSIZE = {"UntypedStorage": 1, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2, "DoubleStorage": 8,
                     "LongStorage": 8, "IntStorage": 4, "ByteStorage": 1, "BoolStorage": 1}


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a storage's header names a global ({module}.{name})")


class _StorageRecord(pickle.Unpickler):
    """Reads the record of torch's legacy storage format without allocating anything: the
    bytes each storage declares (``numel`` × its element size)."""

    def __init__(self, f) -> None:
        super().__init__(f)
        self.declared = 0

    def find_class(self, module: str, name: str):
        if module in ("torch", "torch.storage") and name in _STORAGE_ITEMSIZE:
            return _STORAGE_ITEMSIZE[name]
        raise pickle.UnpicklingError(f"a storage's record names a global ({module}.{name})")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage" and isinstance(pid[1], int)
                and isinstance(pid[4], int) and pid[4] >= 0):
            raise pickle.UnpicklingError("a storage's record is not torch's (storage, type, key, location, numel, view)")
        self.declared += pid[4] * pid[1]


def declared_storage_bytes(data: bytes) -> int:
    """What the storage ``data`` (torch's legacy format, as ``UntypedStorage.__reduce__`` writes
    it) declares it holds, read before ``torch.load`` allocates it; raises UnpicklingError when
    the record is not torch's or declares more bytes than ``data`` carries."""
    f = io.BytesIO(data)
    for _ in range(3):  # magic number, protocol version, system info
        _NoGlobals(f).load()
    record = _StorageRecord(f)
    record.load()
    keys = _NoGlobals(f).load()
    if not isinstance(keys, list):
        raise pickle.UnpicklingError("a storage's keys are not a list")
    present = len(data) - f.tell() - 8 * len(keys)  # each storage's bytes follow its 8-byte size
    if record.declared > present:
        raise pickle.UnpicklingError(f"a storage declares {record.declared} bytes but carries {present}")
    return record.declared


def _unpickler(data: bytes, old_protocols: bool, budget: _Budget) -> pickle.Unpickler:
    def load_storage(raw: bytes):
        if not isinstance(raw, bytes):
            raise pickle.UnpicklingError("a storage is not bytes")
        budget.take(declared_storage_bytes(raw))
        return _load_storage(raw)

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if (module, name) == ("torch.storage", "_load_from_bytes"):
                return load_storage
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


def decode_tensors(payload: str, old_protocols: bool, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """One rank's payload as name → tensor (``old_protocols``: pickle protocol 2 and older
    admitted, 0.5.21+); raises ValueError (bad base64, bad pickle, refused opcodes, not a dict
    of tensors, a tensor :func:`tensor_problem` refuses) or RuntimeError (a blocked global).
    Nothing is allocated beyond what the payload carries: each storage's declared size is read
    first and must be present, and all of them together at most ``max_bytes`` (the largest
    adapter the engine could serve: :meth:`AdapterStore.max_adapter_bytes`). CPU-bound: the
    route runs it in a worker thread."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the serialized tensors are not base64: {exc}") from None
    _check_opcodes(raw)
    try:
        data = _unpickler(raw, old_protocols, _Budget(max_bytes)).load()
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
