"""Token log-probabilities and entropies from logits, in float32.

With ``z = float32(logits) / temperature`` over the vocabulary axis (last) and ``y`` the label
(the sampled token id):

    logp(y)  = z_y - logsumexp(z)                   (= log_softmax(z)[y])
    entropy  = logsumexp(z) - sum_v softmax(z)_v z_v (= -sum_v p_v log p_v)

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
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + (V,)"
        )
    z = _scaled(logits, temperature)
    picked = z.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` in float32; ``(..., V) -> (...)``."""
    z = _scaled(logits, temperature)
    lse = torch.logsumexp(z, dim=-1)
    return lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both of the above sharing one ``logsumexp``; returns ``(logp, entropy)``."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + (V,)"
        )
    z = _scaled(logits, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1) - lse
    ent = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logp, ent
