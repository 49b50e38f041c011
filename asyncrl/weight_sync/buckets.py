"""Bucket planning and (un)flattening for weight broadcasts.

A *bucket* is a run of consecutive named tensors of one dtype whose total size stays
under ``bucket_bytes`` (a tensor larger than that gets a bucket of its own). Buckets keep
the input order, so broadcasting them one after another sends every tensor in ``names``
order, as SGLang's receiver expects. ``Bucket.http_fields()`` is the ``names`` /
``dtypes`` / ``shapes`` part of an ``/update_weights_from_distributed`` body.

``load_format="flattened_bucket"`` sends a bucket as ONE broadcast of the concatenation of
its flattened tensors: :func:`flatten_bucket` on the sender, :func:`unflatten_bucket` on the
receiver (views into the flat tensor, no copy).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
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


@dataclass
class Bucket:
    """Names, dtype and shapes of one bucket, in broadcast order."""

    names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    dtype: torch.dtype = torch.float32

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def http_fields(self) -> dict:
        """``{"names", "dtypes", "shapes"}`` for the HTTP update call."""
        return {
            "names": list(self.names),
            "dtypes": [dtype_name(self.dtype)] * len(self.names),
            "shapes": [list(s) for s in self.shapes],
        }


def plan_buckets(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
) -> list[Bucket]:
    """Split ``named_tensors`` (in order) into dtype-homogeneous buckets of at most
    ``bucket_bytes`` each (one oversized tensor makes its own bucket). Only shapes and
    dtypes are read, so meta tensors work too."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    buckets: list[Bucket] = []
    current: Bucket | None = None
    size = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if current is None or current.dtype != tensor.dtype or (current.names and size + nbytes > bucket_bytes):
            current = Bucket(dtype=tensor.dtype)
            buckets.append(current)
            size = 0
        current.names.append(name)
        current.shapes.append(list(tensor.shape))
        size += nbytes
    return buckets


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor holding ``tensors`` back to back (all one dtype)."""
    if not tensors:
        raise ValueError("empty bucket")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"a flattened bucket needs one dtype, got {sorted(map(str, dtypes))}")
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_bucket(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of ``flat`` with the given shapes, in order; ValueError if sizes disagree."""
    sizes = [math.prod(s) for s in shapes]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(f"flat tensor of {flat.numel()} elements does not hold shapes totalling {sum(sizes)}")
    return [chunk.view(list(shape)) for chunk, shape in zip(torch.split(flat, sizes), shapes, strict=True)]
