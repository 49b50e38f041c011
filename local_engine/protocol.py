"""Request bodies of the SGLang HTTP subset local_engine serves, as strict pydantic models.

Like SGLang, unknown top-level fields are ignored (an unknown ``sampling_params`` key is refused,
as SGLang's ``SamplingParams(**...)`` refuses it), and ``null`` means "use the default" for the fields
SGLang types ``Optional``; a field SGLang types without ``None`` (``flush_cache: bool``,
``group_name: str``, ``mode: Literal[...]``) refuses ``null`` with 400 here as there
(``NULL_REFUSED`` per body, checked against every release's classes by
``tests/contract/test_null_strictness.py``: as strict as the strictest supported release).
Unlike a plain pydantic model, types are strict (``"5"`` is not an int, ``1`` is not a bool) and
floats must be finite, so malformed input fails here with 400 instead of deeper down.

Fields SGLang has but local_engine cannot honour (batches, ``n>1``, penalties, grammars,
images, hidden states, sessions) are rejected with a clear message rather than
silently ignored: an RL client must not believe it got a behaviour it did not.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.wire.sync import DEFAULT_GROUP_NAME

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
MAX_TOP_LOGPROBS = 20  # OpenAI's cap; each one costs a triple per generated token in the answer


class _Body(BaseModel):
    model_config = _STRICT
    NULL_REFUSED: ClassVar[frozenset[str]] = frozenset()
    """Fields SGLang types without ``None``: ``null`` there is a 400, not the default."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.NULL_REFUSED}
        return data


def _version(value: Any) -> Any:
    """Weight versions are strings, as in SGLang, whose validation (pydantic, lax, after a JSON
    round trip) refuses a number for a ``str`` field: ``3`` is a 400 there, so it is here."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ValueError(f"a weight version is a string (send \"{value}\"), got the number {value}")
    return value


class SamplingParams(_Body):
    """``sampling_params`` of /generate (SGLang ``SamplingParams``; defaults are SGLang's)."""

    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = 1
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        """SGLang builds its ``SamplingParams`` (a msgspec Struct) with ``**sampling_params``, so an
        unknown key fails the request there (a TypeError, and 0.5.22+'s contract gate); here
        it is a 400 naming the key, never ignored."""
        if isinstance(data, dict):
            unknown = sorted(k for k in data if k not in cls.model_fields)
            if unknown:
                raise ValueError(f"unknown sampling parameters {unknown}: local_engine takes {sorted(cls.model_fields)}")
        return data

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 1 and v != -1:
            raise ValueError("top_k must be -1 (disabled) or at least 1")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _supported(self) -> SamplingParams:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens must not exceed max_new_tokens")
        if self.n != 1:
            raise ValueError("n > 1 is not supported by local_engine: send one request per sample")
        unsupported = {
            "repetition_penalty": self.repetition_penalty != 1.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "logit_bias": bool(self.logit_bias),
            "json_schema": self.json_schema is not None,
            "regex": self.regex is not None,
            "ebnf": self.ebnf is not None,
            "structural_tag": self.structural_tag is not None,
            "stop_regex": bool(self.stop_regex),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"sampling params not supported by local_engine: {', '.join(bad)}")
        return self

    @property
    def stop_strings(self) -> list[str]:
        items = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in items if s]


class GenerateBody(_Body):
    """Body of /generate (single request only)."""

    NULL_REFUSED = frozenset({"stream", "return_text_in_logprobs", "return_prompt_token_ids", "return_routed_experts",
                              "return_hidden_states",  # a plain bool up to 0.5.16
                              "routed_experts_start_len"})  # a plain int in every release
    text: str | list[Any] | None = None
    input_ids: list[Any] | None = None
    sampling_params: dict[str, Any] | list[Any] = Field(default_factory=dict)
    rid: str | list[Any] | None = None
    return_logprob: bool | list[Any] = False
    logprob_start_len: int | list[Any] = -1
    top_logprobs_num: int | list[Any] = 0
    token_ids_logprob: Any = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_hidden_states: bool | list[Any] = False
    return_routed_experts: bool = False
    """Routed experts of every position in the final answer (:mod:`local_engine.routes`); answered
    without them on an engine started without ``--enable-return-routed-experts``, as SGLang does."""
    routed_experts_start_len: int = 0
    return_prompt_token_ids: bool = False
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    session_params: Any = None
    return_sampling_mask: bool | list[Any] | None = None
    """SGLang 0.5.16+: each output token's sampling support and its behaviour log-prob under the
    truncated distribution (:mod:`local_engine.sampler`); refused on an engine emulating an
    older release (which would drop the field: a client must not think it got them)."""
    sampling_logprobs_mode: Literal["selected", "support"] | list[Any] | None = None
    """SGLang 0.5.21+: ``selected`` (default) or ``support``; needs ``return_sampling_mask``."""

    @model_validator(mode="after")
    def _single(self) -> GenerateBody:
        batch_fields = [
            name
            for name in ("text", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
                         "return_sampling_mask", "sampling_logprobs_mode")
            if isinstance(getattr(self, name), list)
        ]
        if self.input_ids is not None and self.input_ids and isinstance(self.input_ids[0], list):
            batch_fields.append("input_ids")
        if batch_fields:
            raise ValueError(f"batch requests are not supported by local_engine (list-valued {', '.join(batch_fields)}): send one request per prompt")
        if self.input_ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in self.input_ids):
            raise ValueError("input_ids must be a list of integers")
        unsupported = [
            name
            for name in ("token_ids_logprob", "image_data", "audio_data", "video_data", "input_embeds", "session_params")
            if getattr(self, name) is not None
        ]
        unsupported += [n for n in ("return_hidden_states",) if getattr(self, n)]
        if self.sampling_logprobs_mode is not None and not self.return_sampling_mask:
            raise ValueError("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
        if self.lora_path is not None and not isinstance(self.lora_path, str):
            raise ValueError("lora_path must be one adapter name (a string): local_engine serves single requests")
        if unsupported:
            raise ValueError(f"fields not supported by local_engine: {', '.join(unsupported)}")
        if self.logprob_start_len < -1:
            raise ValueError("logprob_start_len must be -1 or a prompt position")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be between 0 and {MAX_TOP_LOGPROBS}")
        return self

    def sampling(self) -> SamplingParams:
        return SamplingParams.model_validate(self.sampling_params)


class AbortBody(_Body):
    """/abort_request: ``rid`` must be a request the engine tracks exactly (else nothing
    happens, as on SGLang); or ``abort_all``."""

    NULL_REFUSED = frozenset({"abort_all"})
    rid: str = ""
    abort_all: bool = False


class SessionBody(_Body):
    """/begin_weight_update and /end_weight_update (SGLang 0.5.21+)."""

    NULL_REFUSED = frozenset({"selector"})
    selector: Literal["target", "draft", "all"] = "all"


class CheckWeightsBody(_Body):
    """/weights_checker (SGLang 0.5.15+). local_engine answers ``action`` ``checksum`` only
    (SGLang's ``snapshot``, ``reset_tensors`` and ``compare`` are debugging aids; others are
    "Unsupported" there too); ``allow_quant_error`` has no effect (no quantised weights);
    ``skip_tensor_list`` (0.5.21+): substrings of tensor names left out; ``selector`` (0.5.21+):
    local_engine has no draft model, so every value checks the target."""

    NULL_REFUSED = frozenset({"action", "allow_quant_error", "selector"})
    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Literal["target", "draft", "all"] = "all"


class SlowDownBody(_Body):
    """``/slow_down`` (SGLang ``SlowDownReqInput``: the field is required, null turns it off)."""

    NULL_REFUSED = frozenset({"forward_sleep_time"})
    forward_sleep_time: float | None = Field(..., ge=0.0, le=3600.0)


class PauseBody(_Body):
    """/pause_generation: ``abort``, ``retract`` (requests kept, KV freed, prefilled again on continue) or ``in_place`` (requests and KV kept)."""

    NULL_REFUSED = frozenset({"mode"})
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(_Body):
    """/continue_generation. ``torch_empty_cache`` is accepted and has no effect on CPU."""

    NULL_REFUSED = frozenset({"torch_empty_cache"})
    torch_empty_cache: bool = True


class InitGroupBody(_Body):
    """/init_weights_update_group. Only ``gloo`` exists on CPU; like SGLang, the default is nccl."""

    NULL_REFUSED = frozenset({"group_name", "backend"})
    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field(DEFAULT_GROUP_NAME, min_length=1)
    backend: str = "nccl"

    @model_validator(mode="after")
    def _ranks(self) -> InitGroupBody:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class DestroyGroupBody(_Body):
    """/destroy_weights_update_group."""

    NULL_REFUSED = frozenset({"group_name"})
    group_name: str = DEFAULT_GROUP_NAME


class UpdateDistributedBody(_Body):
    """/update_weights_from_distributed (SGLang ``UpdateWeightsFromDistributedReqInput``)."""

    NULL_REFUSED = frozenset({"group_name", "flush_cache", "abort_all_requests", "selector", "torch_empty_cache"})
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False

    _v = field_validator("weight_version", mode="before")(_version)

    @model_validator(mode="after")
    def _lengths(self) -> UpdateDistributedBody:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(self.names)}, {len(self.dtypes)}, {len(self.shapes)})")
        if any(d < 0 for shape in self.shapes for d in shape):
            raise ValueError("shapes must not have negative dimensions")
        if len(set(self.names)) != len(self.names):
            raise ValueError("names must be unique")
        return self


class UpdateDiskBody(_Body):
    """/update_weights_from_disk: a Hugging Face safetensors directory, same parameter names."""

    NULL_REFUSED = frozenset({"abort_all_requests", "flush_cache", "keep_pause"})
    model_path: str = Field(min_length=1)
    load_format: Literal["auto", "safetensors"] | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    keep_pause: bool = False

    _v = field_validator("weight_version", mode="before")(_version)


class UpdateVersionBody(_Body):
    """/update_weight_version."""

    NULL_REFUSED = frozenset({"abort_all_requests"})
    new_version: str = Field(min_length=1)
    abort_all_requests: bool = True

    _v = field_validator("new_version", mode="before")(_version)
