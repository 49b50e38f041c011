"""Per-token KL estimators between the current policy and a frozen reference (verl's ``kl_penalty``).

With ``d = logp - ref_logp`` (log-probabilities of the *sampled* token under the current policy
``pi`` and the reference ``ref``), tokens being sampled from (approximately) ``pi``:

- ``kl``  (k1): ``d``                                  unbiased for KL(pi || ref), high variance, can be < 0
- ``abs``:      ``|d|``
- ``mse`` (k2): ``0.5 * d^2``
- ``low_var_kl`` (k3): ``exp(-d') + d' - 1`` with ``d' = clamp(d, -20, 20)``, then clamped to ``[-10, 10]``

(Schulman, "Approximating KL divergence", 2020). ``low_var_kl`` is verl's code verbatim:
``kl = clamp(ref - logp, -20, 20); clamp(exp(kl) - kl - 1, -10, 10)``; it is >= 0 and unbiased
for KL(pi || ref) before the clamps. The clamps cut the gradient where they are active.

The aliases ``k1``, ``k2``, ``k3`` are accepted as in verl. Not covered: verl's ``full`` (needs
the whole vocabulary) and its straight-through ``k3+`` variants. The KL *loss* is
``kl_loss_coef * agg_loss(kl_penalty(...), mask, loss_agg_mode)`` (see ``actor_loss``).

Shapes: any; ``logp`` and ``ref_logp`` broadcast together. Returns a tensor of that shape.
"""

from __future__ import annotations

import torch

KL_TYPES = ("kl", "abs", "mse", "low_var_kl")
_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate of ``kl_type`` (``kl``, ``abs``, ``mse``, ``low_var_kl``; see module doc)."""
    kind = _ALIASES.get(kl_type, kl_type)
    if kind == "kl":
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "mse":
        return 0.5 * (logp - ref_logp).square()
    if kind == "low_var_kl":
        kl = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(kl) - kl - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"unknown kl type {kl_type!r}; expected one of {KL_TYPES} (or k1/k2/k3)")
