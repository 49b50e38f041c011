"""The Trajectory wire schema, version 1: what the rollout service publishes and the
trainer consumes.

Encoding: MessagePack through msgspec, with the schema tag ``asyncrl.trajectory/1`` in the
``schema`` field. Measured against orjson on this machine (``bench/wire.py``) it is half the
size (about 12 bytes per token instead of 24) and encodes faster, and decoding is typed, so
a malformed payload fails with the path of the bad field.

Layout: ``token_ids`` holds the prompt followed by the response (every turn: model output,
tool results, environment text). The per-token arrays ``loss_mask``,
``rollout_logprobs`` and ``weight_versions`` cover the response only (length
``len(token_ids) - prompt_length``):

- ``loss_mask``: 1 for tokens the model produced, 0 for tool/environment tokens;
- ``rollout_logprobs``: the engine's logprob of each model token (0.0 where mask is 0);
- ``weight_versions``: the weight version that produced each model token, -1 where mask is 0.

``sampling`` records the sampling parameters the logprobs refer to, as spans: span ``k``
applies from response offset ``sampling[k].start`` up to the next span's start (the first
span starts at 0). The rollout service starts a span wherever a turn (or a session request)
changed them. Logprobs are those of ``log_softmax(logits / T)`` *before* top-k / top-p /
min-p truncation (SGLang's and local_engine's rule), with ``T = 1`` for greedy (T = 0):
the trainer reproduces them by dividing its logits by each token's ``T``. An empty list
means one span of ``temperature`` with no truncation (publishers before ``sampling``).

``behaviour_logprobs`` (empty, or one per response token): the log-prob of each model token
under the distribution it was actually drawn from — the truncated, renormalised one in spans
whose ``behaviour_logprobs`` flag is set (the engine's sampling mask, SGLang 0.5.16+
``output_token_sampling_logprobs``), ``rollout_logprobs``' value elsewhere (0.0 where mask is
0). The trainer's importance ratios use it as the behaviour policy; a truncated span without
the flag has no exact behaviour log-prob (:attr:`Trajectory.truncation_uncorrected`).

``failure`` names an infrastructure failure that ended or spoiled the episode (the engine
failed, the reward function crashed, an environment call expired, the agent crashed, or a
per-request pause cancelled it because the trainer would drop it for staleness: ``stale_cancelled``): such
a trajectory is never trained (docs/algorithms.md, "What is trained"); "" for a genuine
episode, whatever its reward.

Invariants checked on construction and decode: the arrays have equal lengths, masks are 0/1,
versions are -1 exactly where the mask is 0, model-token logprobs are finite and <= 0 (also
``behaviour_logprobs``, which is empty or as long as the response),
``0 <= group_index < group_size``, ``version_start <= version_end``, sampling spans start at
0, increase strictly, stay within the response and hold valid parameters, ``reward`` is finite
and within ``±REWARD_BOUND`` (a NaN or infinite reward turns a whole GRPO group's advantages
into NaN and skips the step's update: issue 30), ``id`` is a plain file name
(:func:`asyncrl.files.is_plain_name`: it names the trajectory's file in the outbox).

``routed_experts`` (optional): a mixture-of-experts policy's expert ids per position, for
router replay (:mod:`asyncrl.wire.routed_experts`: ``len(token_ids) - 1`` rows of ``layers ×
top_k`` ids, checked against the token count).

Not covered: multimodal inputs, per-token top-k logprobs.
"""

from __future__ import annotations

import math
from itertools import compress
from operator import not_
from typing import Any, Literal

import msgspec

from asyncrl.files import is_plain_name
from asyncrl.wire.routed_experts import RoutedExperts

SCHEMA_TAG = "asyncrl.trajectory/1"
SCHEMA_PREFIX = "asyncrl.trajectory/"

FinishReason = Literal["stop", "length", "abort", "tool_limit", "turn_limit", "error", "expired"]
Failure = Literal["", "engine_error", "reward_error", "environment_expired", "agent_crash", "stale_cancelled"]
REWARD_BOUND = 1e6
"""Largest reward magnitude a trajectory may carry (a sum of 1,024 of them stays finite)."""
GREEDY_TEMPERATURE = 1e-6
"""Below this a temperature means greedy (SGLang's rule); its logprobs are at T = 1."""


class WireDecodeError(ValueError):
    """A payload is not a valid Trajectory of a version this code understands."""


class SamplingSpan(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling parameters of the model tokens from response offset ``start`` on (module doc)."""

    start: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    behaviour_logprobs: bool = False
    """This span's model tokens have their log-prob under the truncated distribution they were
    drawn from in :attr:`Trajectory.behaviour_logprobs` (module doc)."""

    @property
    def logprob_temperature(self) -> float:
        """The temperature the reported logprobs are scaled by (1 for greedy)."""
        return 1.0 if self.temperature < GREEDY_TEMPERATURE else self.temperature

    @property
    def truncated(self) -> bool:
        """True when the sampled distribution was cut (top-p / top-k / min-p) while the
        logprobs describe the uncut one; greedy is not counted (it is not a sample)."""
        if self.temperature < GREEDY_TEMPERATURE:
            return False
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0

    @property
    def uncorrected(self) -> bool:
        """Truncated without the behaviour log-probs of its tokens (the importance ratio then
        ignores the truncation)."""
        return self.truncated and not self.behaviour_logprobs


class Trajectory(msgspec.Struct, kw_only=True, tag_field="schema", tag=SCHEMA_TAG, omit_defaults=True):
    """One finished episode. Field order is the wire order; see the module doc for invariants."""

    id: str
    """Globally unique; also the ``Nats-Msg-Id`` (publish dedup) and the trainer's dedup key."""
    run_id: str
    group_id: str
    """All trajectories of one prompt's group share it."""
    group_size: int
    group_index: int
    prompt_id: str
    data_source: str
    token_ids: list[int]
    prompt_length: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    weight_versions: list[int]
    reward: float = 0.0
    reward_details: dict[str, Any] = msgspec.field(default_factory=dict)
    finish_reason: FinishReason = "stop"
    num_turns: int = 0
    num_tool_calls: int = 0
    version_start: int = 0
    """Weight version when the trajectory's first token was generated (verl's param_version_start)."""
    version_end: int = 0
    """Weight version of its last generated token (verl's param_version_end)."""
    temperature: float = 1.0
    """Sampling temperature of the first turn; ``sampling`` has every turn's (module doc)."""
    sampling: list[SamplingSpan] = msgspec.field(default_factory=list)
    """Sampling parameters per span of the response (module doc)."""
    behaviour_logprobs: list[float] = msgspec.field(default_factory=list)
    """Empty, or each response token's log-prob under the distribution it was drawn from (module doc)."""
    failure: Failure = ""
    """Infrastructure failure that makes it untrainable; "" for a genuine episode (module doc)."""
    timings: dict[str, float] = msgspec.field(default_factory=dict)
    """Seconds: ``generate``, ``tools``, ``wait``, ``total`` (and others, by name)."""
    created_at: float = 0.0
    """Unix time the trajectory finished."""
    attempt: int = 0
    """Increments when an episode is restarted from scratch (not on resume)."""
    messages: list[dict[str, Any]] | None = None
    """The conversation as chat messages, for debugging only; training uses ``token_ids``."""
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    routed_experts: RoutedExperts | None = None
    """A mixture-of-experts policy's routes per position, for replay (:mod:`.routed_experts`);
    None for a dense model or without router replay."""

    def __post_init__(self) -> None:
        errors = _invariant_errors(self)
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def response_length(self) -> int:
        return len(self.token_ids) - self.prompt_length

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.prompt_length:]

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    def sampling_spans(self) -> list[SamplingSpan]:
        """``sampling``, or the single span ``temperature`` implies when it is empty."""
        return self.sampling or [SamplingSpan(start=0, temperature=self.temperature)]

    def token_temperatures(self) -> list[float]:
        """The logprob temperature of every response token (module doc)."""
        spans = self.sampling_spans()
        out: list[float] = []
        for k, span in enumerate(spans):
            end = spans[k + 1].start if k + 1 < len(spans) else self.response_length
            out.extend([span.logprob_temperature] * (end - span.start))
        return out

    @property
    def sampling_truncated(self) -> bool:
        """True when any span sampled from a truncated distribution (:attr:`SamplingSpan.truncated`)."""
        return any(span.truncated for span in self.sampling_spans())

    @property
    def truncation_uncorrected(self) -> bool:
        """True when some span sampled from a truncated distribution without recording the
        behaviour log-probs of its tokens (:attr:`SamplingSpan.uncorrected`)."""
        return any(span.uncorrected for span in self.sampling_spans())

    def behaviour_logprob_list(self) -> list[float]:
        """The behaviour policy's log-prob of each response token: ``behaviour_logprobs`` where
        recorded, else ``rollout_logprobs`` (module doc)."""
        return self.behaviour_logprobs or self.rollout_logprobs

    @property
    def is_partial(self) -> bool:
        """True when its model tokens came from more than one weight version (resumed across a sync)."""
        return self.version_end != self.version_start


MAX_VERSION = 2**63 - 1
"""Largest weight version anywhere on the wire: int63, what every holder stores (issue 48)."""


def _invariant_errors(t: Trajectory) -> list[str]:
    errors = []
    n = len(t.token_ids) - t.prompt_length
    if t.prompt_length < 1 or n < 0:
        errors.append(f"prompt_length {t.prompt_length} must be in [1, len(token_ids)={len(t.token_ids)}]")
        return errors
    for name in ("loss_mask", "rollout_logprobs", "weight_versions"):
        got = len(getattr(t, name))
        if got != n:
            errors.append(f"{name} has {got} entries, the response has {n} tokens")
    if errors:
        return errors
    # Checks run at C speed (set/min/compress/map): decoding a 32K-token trajectory must
    # stay cheaper than the JSON baseline (bench/wire.py), so no per-token Python loop here.
    if t.token_ids and min(t.token_ids) < 0:
        errors.append("token_ids must be non-negative")
    if not set(t.loss_mask) <= {0, 1}:
        errors.append(f"loss_mask values must be 0 or 1, got {sorted(set(t.loss_mask) - {0, 1})[:3]}")
        return errors
    env_versions = set(compress(t.weight_versions, map(not_, t.loss_mask)))
    if env_versions - {-1}:
        errors.append(f"weight_versions must be -1 exactly where loss_mask is 0, found {sorted(env_versions - {-1})[:3]}")
    model_versions = list(compress(t.weight_versions, t.loss_mask))
    if model_versions and min(model_versions) < 0:
        errors.append("weight_versions must be >= 0 for model tokens (loss_mask 1)")
    model_logprobs = list(compress(t.rollout_logprobs, t.loss_mask))
    if not all(map(math.isfinite, model_logprobs)) or (model_logprobs and max(model_logprobs) > 0.0):
        errors.append("rollout_logprobs must be finite and <= 0 for model tokens (loss_mask 1)")
    if t.behaviour_logprobs:
        behaviour = list(compress(t.behaviour_logprobs, t.loss_mask))
        if len(t.behaviour_logprobs) != n:
            errors.append(f"behaviour_logprobs has {len(t.behaviour_logprobs)} entries, the response has {n} tokens")
        elif not all(map(math.isfinite, behaviour)) or (behaviour and max(behaviour) > 0.0):
            errors.append("behaviour_logprobs must be finite and <= 0 for model tokens (loss_mask 1)")
    if not (0 <= t.group_index < t.group_size):
        errors.append(f"group_index {t.group_index} must be in [0, group_size={t.group_size})")
    if t.version_start > t.version_end:
        errors.append(f"version_start {t.version_start} > version_end {t.version_end}")
    if not (math.isfinite(t.temperature) and t.temperature >= 0.0):
        errors.append(f"temperature {t.temperature!r} must be finite and >= 0")
    if max(abs(t.version_start), abs(t.version_end)) > MAX_VERSION or (model_versions and max(model_versions) > MAX_VERSION):
        errors.append(f"weight versions must be at most {MAX_VERSION} (int63)")
    if not is_plain_name(t.id):
        errors.append(f"id {t.id[:80]!r} must be a plain name (letters, digits, _ . : -, not starting with a dot)")
    if not (math.isfinite(t.reward) and abs(t.reward) <= REWARD_BOUND):
        errors.append(f"reward {t.reward!r} must be finite and within ±{REWARD_BOUND:g}")
    errors.extend(_sampling_errors(t.sampling, n))
    if t.routed_experts is not None:
        errors.extend(t.routed_experts.errors(len(t.token_ids) - 1))
    return errors


def _sampling_errors(spans: list[SamplingSpan], n: int) -> list[str]:
    if not spans:
        return []
    errors = []
    starts = [s.start for s in spans]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] > n:
        errors.append(f"sampling span starts must begin at 0, increase strictly and stay <= {n}, got {starts[:5]}")
    for s in spans:
        if not (s.temperature >= 0.0 and math.isfinite(s.temperature)) or not 0.0 < s.top_p <= 1.0 \
                or s.top_k < -1 or s.top_k == 0 or not 0.0 <= s.min_p <= 1.0:
            errors.append(f"sampling span at {s.start} has invalid parameters {s}")
            break
    return errors


class _SchemaOnly(msgspec.Struct):
    schema: str = ""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Trajectory)
_schema_decoder = msgspec.msgpack.Decoder(_SchemaOnly)


def encode_trajectory(traj: Trajectory) -> bytes:
    """The wire bytes of ``traj``."""
    return _encoder.encode(traj)


def decode_trajectory(payload: bytes) -> Trajectory:
    """Decode and validate wire bytes; raise :class:`WireDecodeError` with the reason."""
    try:
        schema = _schema_decoder.decode(payload).schema
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireDecodeError(f"not a trajectory message: {exc}") from None
    if schema != SCHEMA_TAG:
        if schema.startswith(SCHEMA_PREFIX):
            raise WireDecodeError(f"unsupported trajectory schema version {schema!r}; this build reads {SCHEMA_TAG!r}")
        raise WireDecodeError(f"not a trajectory message: schema field is {schema!r}, expected {SCHEMA_TAG!r}")
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireDecodeError(f"malformed trajectory: {exc}") from None
