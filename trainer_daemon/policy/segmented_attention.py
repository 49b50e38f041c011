"""Attention for packed rows without a T x T mask: causal SDPA on each sequence's slice
(the attention implementation ``segmented_sdpa``).

A packed row (:mod:`trainer_daemon.compute.packing`) holds several sequences end to end, and attention
must stay inside each. SDPA takes that only as a dense ``(T, T)`` block-diagonal mask, so it
computes all T² scores and masks most of them: for eight 1 k sequences in an 8 k row, eight
times the work of the sequences' own ΣLᵢ² (and a mask that defeats SDPA's causal fast path).
Measured on this project's 2-core CPU the packed step ran 6.4x slower than the padded one on a
batch of equal lengths (docs/benchmarks.md). This runs ``scaled_dot_product_attention`` with
``is_causal`` on each sequence's slice of q, k and v and concatenates the outputs: the same
maths (tests/trainer/test_segmented_attention.py: log-probs and gradients equal to the dense
mask's), the sequences' own work, no mask in memory. Consecutive sequences of equal length (a
batch of fixed-length samples, the CPU demo's) go through one call as a batch of that length
(a view of the row, no copy), so a row of equal lengths costs one SDPA call per layer, as the
padded layout does (issue 49).

Contract:

- batch size 1 (one packed row); the boundaries come from the ``cu_seq_lens_q`` keyword (the
  cumulative lengths ``[0, L1, L1+L2, ..., T]``, flash-attention's varlen keyword, which
  transformers passes from the model's forward to every attention call), else from
  ``position_ids`` restarting at 0 for each sequence; neither, or boundaries that do not tile
  the row, is a ``ValueError``;
- training and scoring forwards only: no KV cache, no attention weights returned;
- :func:`register` makes the name known to transformers (its attention and mask registries,
  which are process-wide); :func:`trainer_daemon.policy.model.attention_for` picks it for packed rows
  on the CPU. On CUDA, flex_attention or flash-attention run the whole row in one kernel; this
  loops over the sequences in every layer (one host synchronisation each on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

NAME = "segmented_sdpa"


def cu_seq_lens(seq_lens: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[0, L1, L1+L2, ..., T]`` as int32, the form of ``cu_seq_lens_q``."""
    out = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(list(seq_lens), dtype=torch.int32).cumsum(0)
    return out.to(device)


def _bounds(t: int, cu: torch.Tensor | None, position_ids: torch.Tensor | None) -> list[tuple[int, int]]:
    if cu is not None:
        edges = [int(x) for x in cu.tolist()]
    elif position_ids is not None:
        edges = [int(x) for x in (position_ids[0] == 0).nonzero().flatten().tolist()] + [t]
    else:
        raise ValueError(f"{NAME} needs the sequences' boundaries: pass cu_seq_lens_q (or position_ids) to the model")
    if not edges or edges[0] != 0 or edges[-1] != t or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"{NAME}: boundaries {edges[:8]}... do not tile a row of {t} tokens")
    return list(zip(edges[:-1], edges[1:]))


def segmented_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q ``(1, H, T, D)``, k/v ``(1, H_kv, T, D)``
    → ``(1, T, H, D)``. ``attention_mask`` is ignored (the boundaries say everything)."""
    if query.shape[0] != 1:
        raise ValueError(f"{NAME} takes one packed row, got a batch of {query.shape[0]}")
    bounds = _bounds(query.shape[2], kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"))
    gqa = query.shape[1] != key.shape[1]
    parts = []
    for s, e, k in _runs(bounds):  # k consecutive sequences of one length: one call, batched
        length = (e - s) // k
        q, kk, v = (_as_batch(x[:, :, s:e], k, length) for x in (query, key, value))
        o = F.scaled_dot_product_attention(q, kk, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        parts.append(o.transpose(0, 1).reshape(1, o.shape[1], e - s, o.shape[3]) if k > 1 else o)
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _runs(bounds: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(start, end, count)`` of each maximal run of consecutive sequences of equal length."""
    runs: list[tuple[int, int, int]] = []
    for s, e in bounds:
        if runs and (runs[-1][1] - runs[-1][0]) // runs[-1][2] == e - s and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], e, runs[-1][2] + 1)
        else:
            runs.append((s, e, 1))
    return runs


def _as_batch(x: torch.Tensor, k: int, length: int) -> torch.Tensor:
    """``(1, H, k * length, D)`` → ``(k, H, length, D)``: the run's sequences as a batch (a view)."""
    if k == 1:
        return x
    h, d = x.shape[1], x.shape[3]
    return x.reshape(h, k, length, d).transpose(0, 1)


def _no_mask(*args, **kwargs) -> None:
    """The mask function transformers calls for this implementation: none is built."""
    return None


def register() -> str:
    """Register ``segmented_sdpa`` with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, segmented_sdpa_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME
