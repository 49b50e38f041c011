"""The LM head as a log-prob head: log-probs (and entropies) of the scored tokens only, in
chunks, so the ``(tokens × vocabulary)`` logits never exist in float32 at once.

    with log_prob_head(model, labels, temperature, chunk_tokens=2048, entropy=None):
        out = model(input_ids=..., position_ids=..., attention_mask=..., logits_to_keep=score_pos).logits

Inside the block the model's output embedding (``lm_head``) computes, instead of logits for
the kept positions ``(1, N, H) -> (1, N, V)``, ``(1, N, K)``: per position
``log_softmax(h @ W.T / temperature)[label]`` and, with ``entropy``, the entropy of that
distribution (``K = 2``). Chunks of ``chunk_tokens`` positions run under activation
checkpointing (only the hidden states are kept; backward recomputes one chunk's logits at a
time), so peak memory is O(chunk × V) instead of O(N × V). The maths is
:mod:`trainer_daemon.algo.logprobs`' (one ``log_softmax`` in float32 over the logits divided by
the token's temperature; tests/trainer/test_packing.py checks it against the full-logits path).

Why a swapped ``forward`` and not a call of the decoder alone: the projection runs inside the
model's own forward, so under FSDP2 the head's weight (tied to the embedding or not) is the
unsharded parameter of the root unit, and its gradient is reduced with the rest. The module,
its parameters and their names are untouched (checkpoints, exports and the weight sync see
the same model); ``forward`` is restored when the block ends.

``entropy``: None (not computed), ``"metric"`` (detached) or ``"loss"`` (with gradient).
Not covered: vocab-parallel heads, a bias-free fused kernel (liger-kernel's fused linear
cross-entropy returns a reduced loss, not per-token log-probs at per-token temperatures).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
           temperature: torch.Tensor | None, entropy: str | None) -> torch.Tensor:
    z = F.linear(h, weight, bias).float()
    if temperature is not None:  # None: every temperature is 1, and a (chunk × V) pass each way is saved
        z = z / temperature[:, None]
    logq = torch.log_softmax(z, dim=-1)
    logp = logq.gather(-1, labels[:, None]).squeeze(-1)
    if entropy is None:
        return logp[:, None]
    q = logq if entropy == "loss" else logq.detach()
    ent = -(q.exp() * q).sum(dim=-1)
    return torch.stack([logp, ent], dim=-1)


def chunked_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                      temperature: torch.Tensor | None, chunk_tokens: int, entropy: str | None = None) -> torch.Tensor:
    """``(N, H) -> (N, K)`` (module docstring). ``chunk_tokens <= 0``: one chunk. Chunks are
    checkpointed when a gradient is being recorded and there is more than one of them.
    ``temperature`` None means 1 for every position (the caller knows it on the host: asking a
    device tensor would synchronise): the division, a float32 pass over the chunk's logits
    forward and backward, is skipped."""
    n = hidden.shape[0]
    step = n if chunk_tokens <= 0 else chunk_tokens
    recompute = torch.is_grad_enabled() and 0 < chunk_tokens < n
    parts = []
    for s in range(0, n, max(step, 1)):
        temps = None if temperature is None else temperature[s:s + step]
        args = (hidden[s:s + step], weight, bias, labels[s:s + step], temps, entropy)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args))
    return torch.cat(parts, dim=0) if parts else hidden.new_zeros((0, 1 if entropy is None else 2), dtype=torch.float32)


@contextlib.contextmanager
def log_prob_head(model: torch.nn.Module, labels: torch.Tensor, temperature: torch.Tensor | None, chunk_tokens: int,
                  entropy: str | None = None) -> Iterator[None]:
    """Within the block, ``model``'s output embedding answers log-probs (module docstring);
    ``temperature`` None: 1 everywhere (:func:`chunked_log_probs`)."""
    head = model.get_output_embeddings()
    if "forward" in head.__dict__:
        raise RuntimeError("log_prob_head: the output embedding's forward is already swapped")

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states.reshape(-1, hidden_states.shape[-1])
        if h.shape[0] != labels.shape[0]:
            raise ValueError(f"{h.shape[0]} kept positions for {labels.shape[0]} labels: pass logits_to_keep = the scored positions")
        out = chunked_log_probs(h, head.weight, head.bias, labels, temperature, chunk_tokens, entropy)
        return out.reshape(*hidden_states.shape[:-1], out.shape[-1])

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
