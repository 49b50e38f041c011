"""Loss aggregation: verl's four ``loss_agg_mode`` values, normalised by the *global* mini-batch.

A per-token loss matrix ``L`` (shape ``(B, T)``) and a 0/1 loss mask ``M`` (same shape) are
reduced to a scalar. Let ``n_i = sum_t M[i, t]`` (loss tokens of sequence ``i``) and call a
sequence *active* when ``n_i > 0``. With the whole mini-batch in one tensor (``dp_size=1``,
no micro-batching) the modes are exactly verl's (``verl.trainer.ppo.core_algos.agg_loss``):

- ``token-mean``:              ``sum_{i,t} M L / sum_{i,t} M``                 (DAPO token-level loss)
- ``seq-mean-token-sum``:      ``(1/S) sum_{i active} sum_t M L``
- ``seq-mean-token-mean``:     ``(1/S) sum_{i active} (sum_t M L) / n_i``      (original GRPO)
- ``seq-mean-token-sum-norm``: ``sum_{i,t} M L / C``                           (Dr. GRPO)

where ``S`` is the number of active sequences and ``C`` is ``loss_scale_factor`` (default
``T = loss_mat.shape[-1]``, as in verl; pass a constant such as the maximum response length,
otherwise the normaliser changes with each batch's padding).

Gradient accumulation and data parallelism
------------------------------------------
A mini-batch is split over ``dp_size`` ranks and, on each rank, into micro-batches whose
losses are back-propagated one after another (gradients add up), after which FSDP
*averages* the gradients over ranks. To make the resulting gradient identical to the gradient
of the unsplit mini-batch loss, each micro-batch loss is computed with the mini-batch's global
normalisers and multiplied by ``dp_size``:

    micro_loss = (sum over the micro-batch's tokens / sequences) / N_global * dp_size

so that ``(1/dp_size) * sum_ranks sum_micro micro_loss = full-batch loss``. ``N_global`` is
``global_tokens`` (token-mean: loss tokens of the whole mini-batch, all ranks) or
``global_seqs`` (seq-mean modes: active sequences of the whole mini-batch, all ranks); a rank
obtains them with one all-reduce of :func:`count_tokens_and_seqs` over its share. For
``seq-mean-token-sum-norm`` the normaliser is the constant ``C`` and only the ``dp_size``
factor applies. When a global count is not given, the local count of ``mask`` is used (correct
only for a single unsplit batch). If the gradient all-reduce *sums* instead of averaging,
pass ``dp_size=1``.

Deviation from verl: verl does not multiply ``seq-mean-token-sum-norm`` by ``dp_size``, so
its gradient there scales as ``1/dp_size``; asyncrl applies the factor in all four modes.

Not covered: per-token weights other than the mask (multiply them into ``loss_mat``), and
Megatron's pipeline scaling. An empty mini-batch (zero tokens / sequences) gives ``0.0``
(normaliser clamped to 1) instead of verl's NaN.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def count_tokens_and_seqs(mask: torch.Tensor) -> tuple[int, int]:
    """Loss tokens and active sequences (>= 1 loss token) of a ``(B, T)`` mask.

    Sum these over all micro-batches and ranks of a mini-batch to get ``global_tokens`` and
    ``global_seqs`` for :func:`agg_loss`.
    """
    m = mask.to(torch.float64)
    return int(m.sum().item()), int((m.sum(dim=-1) > 0).sum().item())


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    *,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar with verl's ``mode`` (see module doc).

    Args:
        loss_mat: ``(B, T)`` per-token loss (any float dtype; the result keeps its graph).
        mask: ``(B, T)`` 0/1 (bool or float) loss mask; entries where it is 0 are ignored (selected
            away with ``torch.where``, so non-finite padding values do not leak into the result).
        mode: one of :data:`LOSS_AGG_MODES`.
        global_tokens: loss tokens of the whole mini-batch over all ranks (token-mean); None: local.
        global_seqs: active sequences of the whole mini-batch over all ranks (seq-mean modes); None: local.
        dp_size: data-parallel ranks whose gradients are averaged afterwards.
        loss_scale_factor: ``C`` of seq-mean-token-sum-norm; None: ``T``.

    Returns:
        A 0-dim tensor.
    """
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must be equal (B, T)"
        )
    m = mask.to(loss_mat.dtype)
    masked = torch.where(
        mask.bool(), loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    )
    if mode == "token-mean":
        denom = m.sum() if global_tokens is None else global_tokens
        return masked.sum() / _clamp1(denom, loss_mat) * dp_size
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        n_tok = m.sum(dim=-1)
        seq_losses = masked.sum(dim=-1)
        if mode == "seq-mean-token-mean":
            seq_losses = seq_losses / n_tok.clamp(min=1.0)
        active = (n_tok > 0).to(loss_mat.dtype)
        denom = active.sum() if global_seqs is None else global_seqs
        return (seq_losses * active).sum() / _clamp1(denom, loss_mat) * dp_size
    if mode == "seq-mean-token-sum-norm":
        c = float(loss_mat.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
        if c <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {c}")
        return masked.sum() / c * dp_size
    raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {LOSS_AGG_MODES}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask) / max(sum(mask), 1)`` over all elements (for diagnostics)."""
    m = mask.bool()
    total = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
    return total / m.sum().clamp(min=1).to(values.dtype)


def _clamp1(denom: int | float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(denom, torch.Tensor):  # filled on the device: a copied host scalar would synchronise
        return torch.full((), float(denom), dtype=like.dtype, device=like.device).clamp(min=1.0)
    return denom.to(device=like.device, dtype=like.dtype).clamp(min=1.0)
