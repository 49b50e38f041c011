"""Next-token sampling and the logprobs reported for it.

Contract:

- The reported logprob of a token is ``log_softmax(logits / T)`` in fp32 from the raw
  logits of the step that sampled it, where T is the request's temperature, or 1 for
  greedy (T < 1e-6). It is the sampling distribution *before* top-k / top-p / min-p
  truncation and before min_new_tokens masking, so it equals what a teacher-forced forward
  pass of the same weights gives for the same token (divided by the same T).
- Greedy picks the argmax of the raw logits (ties: lowest id).
- Sampling draws from ``softmax(logits / T)`` restricted by top_k, top_p and min_p by
  inverse CDF: one uniform per row, ``searchsorted`` in the cumulative sum, vectorised
  over rows (exponential/Gumbel noise over a 49k vocabulary cost ~50x more on CPU).
  A request seeded under ``--enable-deterministic-inference`` (``Req.seed_sampling``) draws
  its uniform from its own generator, so it is reproducible whatever its batch neighbours do;
  others share the engine's generator.
- ``banned`` token ids (EOS and stop ids before min_new_tokens) are excluded from the
  choice only.
- Sampling masks (SGLang 0.5.16+ ``return_sampling_mask``), for rows with ``sampling_mask``:
  the *support* the token was drawn from (the ids left after banning and top-k / top-p /
  min-p, most likely first, the sampled id always in it) and the *behaviour* log-prob
  ``log(p_y / sum of p over the support)`` with ``p = softmax(logits / T)``: the log-prob of
  the token under the truncated, renormalised distribution it was actually drawn from
  (SGLang's ``selected`` value), plus every support member's (its ``support`` mode). Greedy
  rows: the support is the chosen id, the log-prob 0 (SGLang's rule).
- Device: everything runs on the logits' device (CPU or CUDA) except the uniforms, which
  are drawn on the CPU from CPU generators and copied over, so a seeded request draws the
  same uniform on either device. Results come back as Python numbers (one device-to-host
  copy per result tensor, not one per row).

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
    sampling_mask: bool = False
    """Report the support and the behaviour log-prob of the chosen token (module docstring)."""

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class SampleOutput:
    """Chosen ids, their logprobs, and (when asked) the top-N logprobs of each row."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[float, int]] | None]
    masks: list[SamplingMask | None] = field(default_factory=list)
    """Per row: its sampling mask where the row asked for one (``RowSampling.sampling_mask``)."""


@dataclass
class SamplingMask:
    """The support one token was drawn from and the behaviour log-probs (module docstring)."""

    support: list[int]
    selected_logprob: float
    support_logprobs: list[float]


def scaled_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` in fp32, row-wise; ``temperatures`` is ``[rows]`` (1 for greedy)."""
    return torch.log_softmax(logits.float() / temperatures.unsqueeze(1), dim=-1)


def _truncate(scores: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Set to -inf what top_k / top_p / min_p exclude; ``scores`` are ``[n, vocab]`` logprobs."""
    vocab, dev = scores.shape[1], scores.device
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=dev).unsqueeze(1)
    top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=dev).unsqueeze(1)
    min_p = torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=dev).unsqueeze(1)
    sorted_s, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(sorted_s, dim=-1)
    drop = torch.arange(vocab, device=dev).unsqueeze(0) >= top_k
    drop |= (torch.cumsum(probs, dim=-1) - probs) > top_p  # keep the smallest prefix reaching top_p
    drop |= probs < min_p * probs[:, :1]
    return scores.scatter(1, order, sorted_s.masked_fill(drop, float("-inf")))


def sample(
    logits: torch.Tensor,
    rows: list[RowSampling],
    engine_generator: torch.Generator,
    top_logprobs: list[int] | None = None,
) -> SampleOutput:
    """Pick one token per row of ``logits`` (``[rows, vocab]``, any device) and report its logprob."""
    n, vocab = logits.shape
    dev = logits.device
    temps = torch.tensor([1.0 if r.greedy else r.temperature for r in rows], dtype=torch.float32, device=dev)
    logprobs = scaled_logprobs(logits, temps)
    scores = logprobs
    banned = [(i, r.banned) for i, r in enumerate(rows) if r.banned]
    if banned:
        scores = scores.clone()
        for i, ids in banned:
            scores[i, ids] = float("-inf")
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    chosen = torch.argmax(scores, dim=-1)  # greedy rows: argmax of logprobs == argmax of logits
    if sampled:
        sub = scores[sampled]
        trunc = [j for j, i in enumerate(sampled) if rows[i].top_k > 0 or rows[i].top_p < 1.0 or rows[i].min_p > 0.0]
        if trunc:
            sub[trunc] = _truncate(sub[trunc], [rows[sampled[j]] for j in trunc])
        # Uniforms from CPU generators (module docstring), then one copy to the logits' device.
        u = torch.rand((len(sampled), 1), generator=engine_generator, dtype=torch.float64, device="cpu")
        for j, i in enumerate(sampled):
            if rows[i].generator is not None:
                u[j] = torch.rand((), generator=rows[i].generator, dtype=torch.float64, device="cpu")
        u = u.to(dev)
        cdf = torch.cumsum(torch.exp(sub).double(), dim=-1)  # truncated rows: unnormalised, scale u instead
        idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        chosen[sampled] = idx.clamp(max=vocab - 1)
    masks: list[SamplingMask | None] = [None] * n
    if any(r.sampling_mask for r in rows):
        position = {i: j for j, i in enumerate(sampled)}
        for i, r in enumerate(rows):
            if r.sampling_mask:
                masks[i] = _mask(sub[position[i]] if i in position else None, int(chosen[i]))
    picked = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    top: list[list[tuple[float, int]] | None] = [None] * n
    if top_logprobs and any(top_logprobs):
        k = min(max(top_logprobs), vocab)
        vals, idx = (t.cpu() for t in torch.topk(logprobs, k, dim=-1))
        for i, want in enumerate(top_logprobs):
            if want > 0:
                top[i] = list(zip(vals[i, :want].tolist(), idx[i, :want].tolist(), strict=True))
    return SampleOutput(token_ids=chosen.tolist(), logprobs=picked, top=top, masks=masks)


def _mask(scores: torch.Tensor | None, chosen: int) -> SamplingMask:
    """The sampling mask of one row: ``scores`` are its log-probs after banning and
    truncation (-inf outside the support), None for a greedy row."""
    if scores is None:
        return SamplingMask([chosen], 0.0, [0.0])
    support = torch.isfinite(scores)
    support[chosen] = True  # SGLang: the sampled token is always in the support it reports
    ids = torch.nonzero(support).squeeze(1)
    kept = scores[ids].double()
    order = torch.argsort(kept, descending=True, stable=True)
    ids, kept = ids[order], kept[order]
    renormalised = kept - torch.logsumexp(kept, dim=0)
    at = int(torch.nonzero(ids == chosen)[0, 0])
    values = renormalised.tolist()
    return SamplingMask(ids.tolist(), float(values[at]), values)


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], temperature: float) -> list[float | None]:
    """Logprob of each prompt token given the ones before it; the first is None.

    ``logits`` is ``[len(prompt), vocab]`` where row j predicts token j+1.
    """
    t = 1.0 if temperature < GREEDY_EPS else temperature
    lp = scaled_logprobs(logits[:-1], torch.full((logits.shape[0] - 1,), t, device=logits.device))
    ids = torch.tensor(prompt[1:], dtype=torch.long, device=logits.device)
    values = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist() if len(prompt) > 1 else []
    return [None, *values]
