"""Weight buckets as SGLang's ``flattened_bucket`` format wants them: bytes.

A bucket is a run of named tensors whose bytes are packed back to back into ONE ``uint8``
buffer, in ``names`` order, and broadcast in one collective. Dtypes may differ within a
bucket (SGLang's ``FlattenedTensorBucket.supports_multi_dtypes``), but every tensor must start
at a byte offset that is a multiple of its element size: SGLang 0.5.23 refuses an unaligned
bucket before the broadcast ("Unaligned received tensor"), older versions fail after it.

- :func:`plan_buckets` splits named tensors into buckets of at most ``bucket_bytes`` (a
  tensor larger than that gets a bucket of its own), starting a new bucket where the next
  tensor would be unaligned. With ``first_tiny`` the smallest tensor goes first, alone: the
  first collective of a freshly formed group is then a few bytes under the group-formation
  timeout (an NCCL communicator is created lazily by the first collective on SGLang's side, so
  this is where a missing engine shows).
- :func:`pack_bucket` (sender) fills a ``uint8`` buffer; :func:`unpack_bucket` (receiver)
  returns typed views into one. Both check sizes and alignment.

Only shapes and dtypes are read when planning, so meta tensors work too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from asyncrl.wire.sync import BucketSpec, dtype_itemsize

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
                 "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the string SGLang's body carries)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) → ``torch.bfloat16``; ValueError if unknown."""
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


def byte_layout(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Byte offset of each tensor and the total size; ValueError naming the first tensor whose
    offset is not a multiple of its element size (SGLang's receiver refuses those)."""
    offsets, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        size = dtype_itemsize(dtype)
        if offset % size:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        offsets.append(offset)
        offset += math.prod(shape) * size
    return offsets, offset


@dataclass
class Bucket:
    """Names, dtypes and shapes of one bucket, in broadcast order."""

    names: list[str] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for d, s in zip(self.dtypes, self.shapes))

    def spec(self) -> BucketSpec:
        """The bucket as the sync request and SGLang's update body carry it."""
        return BucketSpec(names=list(self.names), dtypes=[dtype_name(d) for d in self.dtypes],
                          shapes=[list(s) for s in self.shapes])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_buckets(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 *, first_tiny: bool = False) -> list[Bucket]:
    """Split ``named_tensors`` (in order) into aligned buckets of at most ``bucket_bytes``
    (see the module docstring; ``first_tiny`` puts the smallest tensor first, alone)."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    buckets: list[Bucket] = []
    if first_tiny and len(items) > 1:
        i = min(range(len(items)), key=lambda k: (_nbytes(items[k][1]), k))
        name, t = items.pop(i)
        buckets.append(Bucket([name], [t.dtype], [list(t.shape)]))
    current: Bucket | None = None
    size = 0
    for name, t in items:
        nbytes = _nbytes(t)
        fits = current is not None and (not current.names or size + nbytes <= bucket_bytes)
        if not fits or size % t.element_size():
            current = Bucket()
            buckets.append(current)
            size = 0
        current.names.append(name)
        current.dtypes.append(t.dtype)
        current.shapes.append(list(t.shape))
        size += nbytes
    return buckets


def pack_bucket(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bytes of ``tensors`` back to back in one CPU ``uint8`` tensor (``out`` if given: it
    must be uint8 of exactly the right size; reusing one avoids page faults every sync)."""
    if not tensors:
        raise ValueError("empty bucket")
    total = sum(_nbytes(t) for t in tensors)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != total:
        raise ValueError(f"pack buffer must be 1-D uint8 of {total} bytes, got {out.dtype} {list(out.shape)}")
    offset = 0
    for t in tensors:
        n = _nbytes(t)
        if offset % t.element_size():
            raise ValueError(f"tensor of {t.dtype} would start at unaligned byte offset {offset}")
        out[offset:offset + n].view(t.dtype).copy_(t.detach().reshape(-1))
        offset += n
    return out


def unpack_bucket(flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[str],
                  shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Typed views of the ``uint8`` buffer ``flat``, in order; ValueError on a size mismatch
    or an unaligned tensor."""
    offsets, total = byte_layout(names, dtypes, shapes)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"a bucket of {total} bytes needs a 1-D uint8 buffer, got {flat.dtype} {list(flat.shape)}")
    out = []
    for off, dtype, shape in zip(offsets, dtypes, shapes):
        dt = parse_dtype(dtype)
        n = math.prod(shape) * dtype_itemsize(dtype)
        out.append(flat[off:off + n].view(dt).view(list(shape)))
    return out
