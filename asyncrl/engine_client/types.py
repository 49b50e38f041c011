"""Typed results of the engine client, parsed from SGLang's ``/generate`` JSON.

Tokens and logprobs come from ``meta_info.output_token_logprobs`` (``[logprob, id, text]``
triples, the contract's client rule) when present, else from ``output_ids`` with no
logprobs. A result whose ``finish_reason.type`` is ``"abort"`` is *partial*: keep its
tokens and resubmit prompt + output with the remaining budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from asyncrl.wire.sync import weight_version_number


@dataclass(frozen=True)
class FinishReason:
    """``type`` is ``stop`` (``matched``: token id or stop string), ``length`` (``length``)
    or ``abort`` (``message``, ``status_code``)."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    @classmethod
    def parse(cls, raw: Any) -> FinishReason:
        if not isinstance(raw, dict):
            return cls(type="unknown" if raw is None else str(raw))
        return cls(
            type=str(raw.get("type", "unknown")),
            matched=raw.get("matched"),
            length=raw.get("length"),
            message=raw.get("message"),
            status_code=raw.get("status_code"),
        )


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were produced with weight ``version``."""

    version: int
    start: int
    end: int


@dataclass
class GenerateResult:
    """One ``/generate`` answer."""

    rid: str
    text: str
    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    weight_version: int | None
    """The engine's weight version when it answered (its ``meta_info.weight_version`` read as a
    number: ``"default"``, an engine never synced, is 0); None when it reported none."""
    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    e2e_latency: float | None = None
    meta_info: dict[str, Any] = field(default_factory=dict)
    sampling_logprobs: list[float] | None = None
    """Asked with ``return_sampling_mask`` (SGLang 0.5.16+): each output token's log-prob under
    the truncated distribution it was drawn from (``output_token_sampling_logprobs``,
    ``selected`` mode; 0 for greedy tokens); None when not asked or not answered."""
    routed_experts: str | None = None
    """Asked with ``return_routed_experts``: ``meta_info["routed_experts"]`` as the engine sent it
    (base64 int32 rows: :func:`asyncrl.wire.routed_experts.engine_rows`); None when not answered."""

    @property
    def aborted(self) -> bool:
        return self.finish_reason.type == "abort"

    def labelled(self, version: int) -> GenerateResult:
        """This result with every token labelled ``version`` (an adapter sync's requests: the
        adapter asked for, by name, decides the version, whatever the engine reports)."""
        return replace(self, weight_version=version, weight_versions=[])

    def token_versions(self) -> list[int | None]:
        """The weight version of each output token (spans, else the single version)."""
        if not self.weight_versions:
            return [self.weight_version] * len(self.output_ids)
        out: list[int | None] = [None] * len(self.output_ids)
        for span in self.weight_versions:
            for i in range(max(0, span.start), min(span.end, len(out))):
                out[i] = span.version
        return out

    @classmethod
    def parse(cls, body: dict[str, Any]) -> GenerateResult:
        meta = body.get("meta_info") or {}
        triples = meta.get("output_token_logprobs")
        if triples is not None:
            ids = [int(t[1]) for t in triples]
            logprobs: list[float] | None = [float(t[0]) for t in triples]
        else:
            ids = [int(t) for t in body.get("output_ids") or []]
            logprobs = None
        spans = [
            WeightVersionSpan(weight_version_number(s["version"]), int(s["start"]), int(s["end"]))
            for s in meta.get("weight_versions") or []
        ]
        version = meta.get("weight_version")
        return cls(
            rid=str(meta.get("id", "")),
            text=body.get("text") or "",
            output_ids=ids,
            logprobs=logprobs,
            finish_reason=FinishReason.parse(meta.get("finish_reason")),
            weight_version=None if version is None else weight_version_number(version),
            prompt_tokens=meta.get("prompt_tokens"),
            completion_tokens=int(meta.get("completion_tokens", len(ids))),
            cached_tokens=int(meta.get("cached_tokens", 0) or 0),
            weight_versions=spans,
            e2e_latency=meta.get("e2e_latency"),
            meta_info=meta,
            sampling_logprobs=_selected_logprobs(meta.get("output_token_sampling_logprobs"), len(ids)),
            routed_experts=meta.get("routed_experts") if isinstance(meta.get("routed_experts"), str) else None,
        )


def _selected_logprobs(values: Any, n: int) -> list[float] | None:
    """``output_token_sampling_logprobs`` in ``selected`` mode (one float per output token), or
    None when absent or in another shape (``support`` mode: a list per token)."""
    if not isinstance(values, list) or len(values) != n or not all(isinstance(v, (int, float)) for v in values):
        return None
    return [float(v) for v in values]


@dataclass(frozen=True)
class WeightsCheck:
    """SGLang's ``/weights_checker`` answer to ``{"action": "checksum"}`` (0.5.15+):
    ``per_engine_checksum`` (SHA-256 over the per-GPU checksums in rank order) and how many
    ranks answered (``len(ranks)``: with tensor, pipeline or data parallelism, or a draft
    model, one entry per runner). Equal for two engines of the same layout exactly when they
    hold the same weights; engines of different layouts cannot be compared."""

    checksum: str
    ranks: int

    @classmethod
    def parse(cls, body: Any) -> WeightsCheck:
        if not isinstance(body, dict) or not isinstance(body.get("per_engine_checksum"), str):
            raise ValueError(f"a /weights_checker answer without per_engine_checksum: {str(body)[:200]}")
        ranks = body.get("ranks")
        return cls(body["per_engine_checksum"], len(ranks) if isinstance(ranks, list) else 1)
