"""Next-token sampling and the logprobs reported for it.

Contract:

- The reported logprob of a token is ``log_softmax(logits / T)`` in fp32 from the raw
  logits of the step that sampled it, where T is the request's temperature, or 1 for
  greedy (T < 1e-6). It is the sampling distribution *before* top-k / top-p / min-p
  truncation and before min_new_tokens masking, so it equals what a teacher-forced forward
  pass of the same weights gives for the same token (divided by the same T).
- Greedy picks the argmax of the raw logits (ties: lowest id).
- Sampling draws from ``softmax(logits / T)`` restricted by top_k, top_p and min_p, with
  the exponential-race trick (argmax of p / Exp(1) noise). A request with
  ``sampling_seed`` draws its noise from its own generator, so it is reproducible whatever
  its batch neighbours do; others share the engine's generator.
- ``banned`` token ids (EOS and stop ids before min_new_tokens) are excluded from the
  choice only.

Not covered: repetition/frequency/presence penalties, logit_bias, grammars (the protocol
layer refuses them with 400 rather than ignoring them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-6  # SGLang: temperature below this means greedy


@dataclass
class RowSampling:
    """Sampling settings of one row (one request at one step)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    generator: torch.Generator | None = None
    banned: list[int] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class SampleOutput:
    """Chosen ids, their logprobs, and (when asked) the top-N logprobs of each row."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[float, int]] | None]


def scaled_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` in fp32, row-wise; ``temperatures`` is ``[rows]`` (1 for greedy)."""
    return torch.log_softmax(logits.float() / temperatures.unsqueeze(1), dim=-1)


def _truncate(probs: torch.Tensor, row: RowSampling) -> torch.Tensor:
    """Zero the probabilities that top_k / top_p / min_p exclude (one row, ``[vocab]``)."""
    if row.top_k > 0 and row.top_k < probs.shape[0]:
        kth = torch.topk(probs, row.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if row.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, 0)
        drop_sorted = (cum - sorted_p) > row.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if row.min_p > 0.0:
        probs = probs.masked_fill(probs < row.min_p * probs.max(), 0.0)
    return probs


def sample(
    logits: torch.Tensor,
    rows: list[RowSampling],
    engine_generator: torch.Generator,
    top_logprobs: list[int] | None = None,
) -> SampleOutput:
    """Pick one token per row of ``logits`` (``[rows, vocab]``) and report its logprob."""
    temps = torch.tensor([1.0 if r.greedy else r.temperature for r in rows], dtype=torch.float32)
    logprobs = scaled_logprobs(logits, temps)
    chosen: list[int] = []
    for i, row in enumerate(rows):
        scores = logits[i] if row.greedy else logprobs[i]
        if row.banned:
            scores = scores.clone()
            scores[row.banned] = float("-inf")
        if row.greedy:
            chosen.append(int(torch.argmax(scores)))
            continue
        probs = _truncate(torch.exp(scores), row)
        noise = torch.empty_like(probs).exponential_(generator=row.generator or engine_generator)
        chosen.append(int(torch.argmax(probs / noise)))
    ids = torch.tensor(chosen, dtype=torch.long)
    picked = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    top: list[list[tuple[float, int]] | None] = [None] * len(rows)
    if top_logprobs:
        for i, n in enumerate(top_logprobs):
            if n > 0:
                vals, idx = torch.topk(logprobs[i], min(n, logprobs.shape[1]))
                top[i] = list(zip(vals.tolist(), idx.tolist(), strict=True))
    return SampleOutput(token_ids=chosen, logprobs=picked, top=top)


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], temperature: float) -> list[float | None]:
    """Logprob of each prompt token given the ones before it; the first is None.

    ``logits`` is ``[len(prompt), vocab]`` where row j predicts token j+1.
    """
    t = 1.0 if temperature < GREEDY_EPS else temperature
    lp = scaled_logprobs(logits[:-1], torch.full((logits.shape[0] - 1,), t))
    ids = torch.tensor(prompt[1:], dtype=torch.long)
    values = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist() if len(prompt) > 1 else []
    return [None, *values]
