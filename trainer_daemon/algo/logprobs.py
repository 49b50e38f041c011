"""Token log-probabilities and entropies from logits, in float32.

With ``z = float32(logits) / temperature`` over the vocabulary axis (last) and ``y`` the label
(the sampled token id):

    logp(y)  = log_softmax(z)[y]                    (= z_y - logsumexp(z))
    entropy  = -sum_v exp(log_softmax(z)_v) log_softmax(z)_v

Both go through one ``log_softmax``, whose fused backward is cheaper than ``logsumexp``'s
(measured on SmolLM2-135M's 49K vocabulary: the logsumexp form added a ``sub``, an ``exp`` and
a ``mul`` over ``(N, V)`` to every backward).

The temperature must be the one the rollout sampled with (``Trajectory.temperature``),
otherwise the trainer's and the engine's log-probs describe different distributions.

Shapes: ``logits`` ``(..., V)``, ``labels`` ``(...)`` int64 -> ``(...)`` float32. The caller does
the causal shift (the logits at position ``t`` score the token at ``t + 1``) and selects the
response positions. Gradients flow into ``logits``.

Not covered: chunked / fused (e.g. Liger) kernels that avoid materialising a float32 copy of
the ``(N, V)`` logits, and vocab-parallel (tensor-parallel) logits.
"""

from __future__ import annotations

import torch


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log_softmax(logits / temperature)[..., labels]`` in float32; ``(..., V), (...) -> (...)``."""
    _check(logits, labels)
    z = _scaled(logits, temperature)
    return torch.log_softmax(z, dim=-1).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` in float32; ``(..., V) -> (...)``."""
    logq = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    return -(logq.exp() * logq).sum(dim=-1)


def log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both of the above from one ``log_softmax``; returns ``(logp, entropy)``. With
    ``entropy_grad=False`` the entropy is detached (a metric): no graph through it."""
    _check(logits, labels)
    logq = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    logp = logq.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    if entropy_grad:
        return logp, -(logq.exp() * logq).sum(dim=-1)
    with torch.no_grad():
        q = logq.detach()
        return logp, -(q.exp() * q).sum(dim=-1)


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + (V,)"
        )
