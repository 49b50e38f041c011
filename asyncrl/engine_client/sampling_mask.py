"""When the rollout asks an engine for sampling masks, so that truncated sampling has exact
behaviour log-probs (issue 35; docs/algorithms.md, "Truncated sampling").

SGLang reports a token's log-prob under ``softmax(logits / T)`` *before* top-k / top-p / min-p
truncation, while the token was drawn from the truncated, renormalised distribution. From
0.5.16 a request with ``return_sampling_mask: true`` also gets each output token's support and
its log-prob under the truncated distribution (``meta_info.output_token_sampling_logprobs``),
the behaviour policy's exact log-prob.

Contract of :func:`asks_sampling_mask`: a call asks for masks only when

- its sampling is truncated (not greedy: SGLang's greedy mask is the token with log-prob 0,
  which says nothing the untruncated log-prob does not), and
- its support is bounded by ``top_k`` in ``1..MASK_TOP_K_MAX``: the answer lists the support's
  ids for every token, and from 0.5.20 a support over ``--sampling-mask-max-tokens`` (default
  4096) aborts the request with 400, which a top-p alone on a flat distribution reaches, and
- the engine's release (``/server_info``'s ``version``) is 0.5.16 or later.

Calls that do not (top-p or min-p without a bounded ``top_k``, older engines, an engine whose
release is not known yet) keep the untruncated log-probs only; their spans are recorded as
uncorrected (``SamplingSpan.uncorrected``) and ``actor.truncated_sampling`` decides.
"""

from __future__ import annotations

from typing import Any

from asyncrl.wire.trajectory import GREEDY_TEMPERATURE

SAMPLING_MASK_SINCE = (0, 5, 16)
"""First SGLang release with ``return_sampling_mask`` (read from the wheels:
tests/contract/test_release_facts.py)."""
MASK_TOP_K_MAX = 1024
"""Largest ``top_k`` for which masks are asked: a quarter of SGLang's default
``--sampling-mask-max-tokens`` (ties at the cutoff can add ids), and at most that many ids per
token in the answer."""


def asks_sampling_mask(sampling_params: dict[str, Any], release: tuple[int, int, int] | None) -> bool:
    """Whether a call with ``sampling_params`` to an engine of ``release`` asks for sampling
    masks (module docstring)."""
    if release is None or release < SAMPLING_MASK_SINCE:
        return False
    if float(sampling_params.get("temperature", 1.0)) < GREEDY_TEMPERATURE:
        return False
    top_k = int(sampling_params.get("top_k", -1))
    return 0 < top_k <= MASK_TOP_K_MAX
