"""One generation request: its state, its stop rules and the JSON the client gets.

Stop rules, in SGLang's order after each new token:

1. ``len(output) >= max_new_tokens`` → ``{"type":"length","length":N}``;
2. fewer than ``min_new_tokens`` tokens → go on (EOS and stop ids are also banned from
   sampling until then);
3. unless ``ignore_eos``: the token is an EOS id or in ``stop_token_ids`` →
   ``{"type":"stop","matched":<id>}``;
4. a ``stop`` string appears in the decoded tail → ``{"type":"stop","matched":"<str>"}``.

``output_ids`` and the logprobs always keep every generated token (stop and EOS included);
trimming (``no_stop_trim=false``) and ``skip_special_tokens`` affect ``text`` only.

Sampling masks (``return_sampling_mask``, SGLang 0.5.16+): ``meta_info`` carries, per output
token, its support (``output_token_sampling_mask``) and behaviour log-prob
(``output_token_sampling_logprobs``: a float, or a list over the support in ``support`` mode)
and their count (``output_token_sampling_mask_length``); :mod:`local_engine.sampler` defines them.

Routed experts (``return_routed_experts``, :mod:`local_engine.routes`): the final answer's
``meta_info.routed_experts`` covers positions ``[routed_experts_start_len, prompt + output - 1)``.

Weight-version spans: every generated token is stamped with the engine's weight version
at the step that produced it; ``meta_info.weight_versions`` lists ``{"version","start",
"end"}`` spans over output token indices (``end`` exclusive) when there is more than one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from local_engine.protocol import SamplingParams
from local_engine.routes import encode_routes
from local_engine.sampler import RowSampling, SamplingMask

DEFAULT_SAMPLING_SEED = 42
"""SGLang's seed of a request without ``sampling_seed`` under deterministic inference."""


@dataclass
class Req:
    """A request from arrival to its final answer. Mutated only on the event loop."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    arrived: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    versions: list[list[Any]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    aborted_in_queue: bool = False
    abort_sent: bool = False
    """An exact-rid abort was passed on for this request (SGLang 0.5.20+ passes one only)."""
    retractions: int = 0
    """Times a ``retract`` pause freed this request's KV (``num_retractions``); it is then
    prefilled again from :attr:`context_ids` with the weights of that time."""
    abort_message: str | None = None
    kept_prompt_kv: Any = None
    """At a retract, the KV of its prompt as the radix cache keeps it (computed with the weights
    of that time); its re-prefill reuses it unless a cache flush dropped it first
    (:meth:`local_engine.scheduler.Scheduler.retract_all`)."""
    kv_released: bool = False
    """Its KV went to the prefix cache when an abort ended it running (:mod:`local_engine.prefix_cache`)."""
    cached_tokens: int = 0
    """Prompt tokens whose KV a prefill took from the cache instead of computing (``cached_tokens``)."""
    return_sampling_mask: bool = False
    """SGLang 0.5.16+: report each output token's sampling support and behaviour log-prob."""
    sampling_logprobs_mode: str = "selected"
    """SGLang 0.5.21+: ``selected`` (the sampled token's behaviour log-prob) or ``support``
    (every support member's)."""
    output_masks: list[SamplingMask] = field(default_factory=list)
    return_routed_experts: bool = False
    """Report the routed experts of every position (:mod:`local_engine.routes`; only when the
    engine records them)."""
    routed_experts_start_len: int = 0
    route_rows: list[torch.Tensor] = field(default_factory=list)
    """Routed experts of the positions put through the model so far, in order (chunks of
    ``[positions, layers, top_k]``): the context's at its prefill, then one per decode step."""
    kept_prompt_routes: torch.Tensor | None = None
    """At a retract, the routes of the prompt whose KV is kept with it (SGLang keeps routes per
    KV slot): its re-prefill over that KV reports them, not new ones."""
    lora_name: str | None = None
    """``lora_path`` of the request: the adapter it runs on (None: the base model)."""
    adapter: Any = None
    """The :class:`local_engine.lora.Adapter` acquired for it after the pause gate."""
    generator: torch.Generator | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    updated: asyncio.Event = field(default_factory=asyncio.Event)

    def seed_sampling(self, deterministic: bool) -> None:
        """SGLang's rule: under ``--enable-deterministic-inference`` the request samples from its
        own generator seeded with ``sampling_seed`` (42 when not given); otherwise the seed is
        ignored and it shares the engine's generator."""
        if deterministic:
            seed = self.params.sampling_seed if self.params.sampling_seed is not None else DEFAULT_SAMPLING_SEED
            self.generator = torch.Generator().manual_seed(seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logits(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and self.input_logprobs is None

    @property
    def context_ids(self) -> list[int]:
        """What a prefill of this request covers: the prompt, plus the output so far after a retract."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    def row_sampling(self, eos_ids: frozenset[int]) -> RowSampling:
        p = self.params
        banned: list[int] = []
        if len(self.output_ids) < p.min_new_tokens:
            banned = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids))
        return RowSampling(p.temperature, p.top_p, p.top_k, p.min_p, self.generator, banned, self.return_sampling_mask)

    def append(self, token: int, logprob: float, top: list[tuple[float, int]] | None, version: str,
               mask: SamplingMask | None = None) -> None:
        n = len(self.output_ids)
        if self.return_sampling_mask:
            assert mask is not None, "a request that asked for sampling masks got a token without one"
            self.output_masks.append(mask)
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.output_top.append(top)
        if self.versions and self.versions[-1][0] == version:
            self.versions[-1][2] = n + 1
        else:
            self.versions.append([version, n, n + 1])

    def relabel(self, index: int, version: str) -> None:
        """Stamp output token ``index`` with ``version`` (the spans are rebuilt)."""
        labels = [v for v, start, end in self.versions for _ in range(start, end)]
        if not 0 <= index < len(labels) or labels[index] == version:
            return
        labels[index] = version
        spans: list[list[Any]] = []
        for i, v in enumerate(labels):
            if spans and spans[-1][0] == v:
                spans[-1][2] = i + 1
            else:
                spans.append([v, i, i + 1])
        self.versions = spans

    def finish(self, reason: dict[str, Any]) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.done.set()
            self.updated.set()


class StopChecker:
    """Applies the stop rules with one tokenizer and the model's EOS ids."""

    def __init__(self, tokenizer, eos_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids

    def check(self, req: Req) -> dict[str, Any] | None:
        p, out = req.params, req.output_ids
        if len(out) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(out) < p.min_new_tokens:
            return None
        last = out[-1]
        if not p.ignore_eos and (last in self.eos_ids or last in p.stop_token_ids):
            return {"type": "stop", "matched": last}
        stops = p.stop_strings
        if stops:
            width = max(len(s.encode("utf-8")) for s in stops) + 1  # a token holds >= 1 byte
            tail = self.tokenizer.decode(out[-width:], skip_special_tokens=False)
            for s in stops:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None


class Renderer:
    """Builds SGLang-shaped responses (final or cumulative stream chunks)."""

    def __init__(self, tokenizer, spans: bool = True, routes: bool = False):
        self.tokenizer = tokenizer
        self.spans = spans
        self.routes = routes
        """The engine records routed experts (``--enable-return-routed-experts``)."""
        """Finished outputs carry ``weight_versions`` spans (``SglangCompat.weight_version_spans``)."""

    def _token_texts(self, ids: list[int]) -> list[str]:
        return self.tokenizer.batch_decode([[t] for t in ids]) if ids else []

    def text(self, req: Req) -> str:
        p, ids = req.params, req.output_ids
        reason = req.finish_reason or {}
        matched = reason.get("matched")
        if reason.get("type") == "stop" and isinstance(matched, int) and not p.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens) if ids else ""
        if reason.get("type") == "stop" and isinstance(matched, str) and not p.no_stop_trim:
            cut = text.rfind(matched)  # the occurrence that ended generation is the last one
            if cut >= 0:
                text = text[:cut]
        return text

    def render(self, req: Req, weight_version: str) -> dict[str, Any]:
        if req.aborted_in_queue:
            meta = {
                "id": req.rid,
                "finish_reason": req.finish_reason,
                "weight_version": weight_version,
                "e2e_latency": time.monotonic() - req.arrived,
                "completion_tokens": 0,
            }
            return {"text": "", "output_ids": [], "meta_info": meta}
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "weight_version": weight_version,
            "num_retractions": req.retractions,
            "reasoning_tokens": 0,
        }
        if self.spans and req.finished:  # SGLang 0.5.19+: on every finished output, none before
            spans = req.versions or [[weight_version, 0, 0]]
            meta["weight_versions"] = [{"version": v, "start": s, "end": e} for v, s, e in spans]
        if req.return_logprob:
            self._logprobs(req, meta)
        # only the final answer carries them; one aborted before it ran has none (SGLang answers its
        # queued abort from the waiting queue without the key)
        if req.return_routed_experts and req.finished and self.routes and req.route_rows:
            rows = torch.cat(req.route_rows)
            meta["routed_experts"] = encode_routes(rows[: max(0, len(req.prompt_ids) + len(req.output_ids) - 1)]
                                                   [req.routed_experts_start_len:])
        if req.return_sampling_mask:  # SGLang 0.5.16+: cumulative, one entry per output token
            support = req.sampling_logprobs_mode == "support"
            meta["output_token_sampling_mask"] = [m.support for m in req.output_masks]
            meta["output_token_sampling_logprobs"] = [m.support_logprobs if support else m.selected_logprob
                                                      for m in req.output_masks]
            meta["output_token_sampling_mask_length"] = len(req.output_masks)
        # SGLang 0.5.15+: the cache hit split by tier (None without a hit), the DP rank that served
        # it (None: no DP attention), and when the answer left the server
        meta["cached_tokens_details"] = {"device": req.cached_tokens, "host": 0} if req.cached_tokens else None
        meta["dp_rank"] = None
        if req.finished:
            meta["e2e_latency"] = time.monotonic() - req.arrived
        meta["response_sent_to_client_ts"] = time.time()
        return {"text": self.text(req), "output_ids": list(req.output_ids), "meta_info": meta}

    def _logprobs(self, req: Req, meta: dict[str, Any]) -> None:
        with_text = req.return_text_in_logprobs
        out_texts = self._token_texts(req.output_ids) if with_text else [None] * len(req.output_ids)
        meta["output_token_logprobs"] = [
            [lp, t, txt] for lp, t, txt in zip(req.output_logprobs, req.output_ids, out_texts, strict=True)
        ]
        meta["output_token_logprobs_length"] = len(req.output_ids)
        inputs: list[list[Any]] = []
        if req.logprob_start_len >= 0 and req.input_logprobs is not None:
            ids = req.prompt_ids[req.logprob_start_len :]
            lps = req.input_logprobs[req.logprob_start_len :]
            texts = self._token_texts(ids) if with_text else [None] * len(ids)
            inputs = [[lp, t, txt] for lp, t, txt in zip(lps, ids, texts, strict=True)]
        meta["input_token_logprobs"] = inputs
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = []  # input positions' tops are refused (engine.build_request)
            meta["output_top_logprobs"] = [self._top(top, with_text) for top in req.output_top]

    def _top(self, top: list[tuple[float, int]] | None, with_text: bool) -> list[list[Any]] | None:
        if top is None:
            return None
        texts = self._token_texts([t for _, t in top]) if with_text else [None] * len(top)
        return [[lp, t, txt] for (lp, t), txt in zip(top, texts, strict=True)]
