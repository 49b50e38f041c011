"""A checksum of a model's weights that the trainer and an engine compute the same way, so
"engine E holds version v" can be verified rather than asserted.

``weights_checksum(named)``: SHA-256 over the parameters in name order, each as its name, its
shape and its values converted to float32 (so an engine holding bf16 values in fp32, or the
reverse, agrees with the sender whenever the values agree). Tied parameters (one storage under
several names, e.g. ``lm_head.weight`` = ``model.embed_tokens.weight``) count once, under the
first name (:func:`canonical`), as engines and ``engine_weights`` name them.

Cost: one pass over the weights on the CPU (~1 s per GB). local_engine serves it at
``GET /weights_checksum``; SGLang has no such route (docs/sync_agent.md says how to compare
parameters there with ``/get_weights_by_name``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

PREFIX = "sha256:"


def canonical(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named`` without the later names of tied tensors (same storage and shape)."""
    seen: set[tuple] = set()
    out = {}
    for name, t in named.items():
        key = (t.data_ptr(), tuple(t.shape)) if t.numel() else (name,)
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


@torch.no_grad()
def weights_checksum(named: Mapping[str, torch.Tensor]) -> str:
    """The checksum (module docstring) of ``named`` (already canonical: see :func:`canonical`)."""
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return PREFIX + h.hexdigest()
