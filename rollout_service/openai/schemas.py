"""Request bodies of the OpenAI-compatible routes, validated before any tokenisation.

Supported parameters are modelled; parameters asyncrl does not implement are rejected with
a message naming them (never silently ignored: a client asking for ``n=4`` must not train
on one sample believing it got four). Harmless bookkeeping fields (``user``, ``metadata``,
``store``) are accepted and ignored.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.wire.trajectory import REWARD_BOUND, Failure

UNSUPPORTED_CHAT = {
    "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "response_format": None,
    "functions": None, "function_call": None, "audio": None, "modalities": None, "prediction": None,
    "web_search_options": None, "service_tier": None, "reasoning_effort": None,
}
IGNORED = ("user", "metadata", "store")


def reject_surrogates(value: Any, where: str = "body") -> Any:
    """Raise for strings that are not valid Unicode (lone surrogates from ``\\ud800`` escapes):
    they cannot be tokenised or stored, so they are refused up front."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where} contains an unpaired surrogate (invalid Unicode)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            reject_surrogates(k, where)
            reject_surrogates(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            reject_surrogates(v, f"{where}[{i}]")
    return value


def bounded_stop(v):
    """OpenAI's limit on ``stop``: at most 4 sequences (of at most 256 characters here); an
    unbounded list (100 k entries) made every decoded token scan it."""
    items = [v] if isinstance(v, str) else (v or [])
    if len(items) > 4 or any(len(s) > 256 for s in items):
        raise ValueError("at most 4 stop sequences of at most 256 characters")
    return v


class _ValidUnicode(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        return reject_surrogates(data)


class _Strict(_ValidUnicode):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _reject_unknown(self):
        extra = dict(self.model_extra or {})
        for key in IGNORED:
            extra.pop(key, None)
        for key, neutral in UNSUPPORTED_CHAT.items():
            if key in extra and extra[key] not in (neutral, None):
                raise ValueError(f"parameter {key!r} is not supported by asyncrl")
            extra.pop(key, None)
        if extra:
            raise ValueError(f"unsupported parameter(s): {', '.join(sorted(extra))}")
        return self


class FunctionCall(BaseModel):
    name: str = Field(min_length=1, max_length=128)
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            texts = []
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                texts.append(part["text"])
            return "".join(texts)
        return v

    def to_template(self) -> dict[str, Any]:
        """The dict the chat template receives (``developer`` is treated as ``system``)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                  "arguments": c.function.arguments}} for c in self.tool_calls]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
            if self.name:
                out["name"] = self.name
        return out


class FunctionDef(BaseModel):
    """A function tool. ``parameters`` must be a valid JSON Schema (checked against the 2020-12
    metaschema with ``jsonschema``) describing an object, so a malformed schema is a 400 naming
    the field instead of an error inside the chat template."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _a_json_schema_of_an_object(cls, v: dict[str, Any]) -> dict[str, Any]:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        try:
            Draft202012Validator.check_schema(v)
        except SchemaError as exc:
            where = ".".join(str(p) for p in exc.absolute_path) or "parameters"
            raise ValueError(f"not a valid JSON Schema at {where}: {exc.message}") from None
        if v.get("type", "object") != "object":
            raise ValueError(f"must describe an object (type 'object'), not {v.get('type')!r}")
        return v


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[str, str]


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, what the engine's sampler takes (issue 48)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1)

    @field_validator("n", mode="before")
    @classmethod
    def _only_one_choice(cls, v):
        if v is not None and v != 1:
            raise ValueError("n > 1 is not supported: make one request per sample (each becomes its own trajectory)")
        return v

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v):
        return bounded_stop(v)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Strict):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, what the engine's sampler takes (issue 48)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1)
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: str | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v):
        return bounded_stop(v)

    @model_validator(mode="after")
    def _single_prompt(self):
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            self.prompt = p[0]
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(self.prompt, list) and any(t < 0 for t in self.prompt):
            raise ValueError("prompt token ids must be non-negative")
        return self


class SessionCreate(_ValidUnicode):
    model_config = ConfigDict(extra="forbid")
    group_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_:-][A-Za-z0-9_.:-]{0,127}$")
    """Letters, digits, ``_ . : -``, not starting with a dot (never ``.`` or ``..``): ids reach
    the file system (the outbox names a held group by a hash of it, never by the id itself)."""
    group_size: int = Field(1, ge=1, le=1024)
    group_index: int = Field(0, ge=0)
    prompt_id: str | None = Field(None, max_length=256)
    data_source: str = Field("external", max_length=256)
    ground_truth: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _index_in_group(self):
        if self.group_index >= self.group_size:
            raise ValueError(f"group_index {self.group_index} must be < group_size {self.group_size}")
        return self


class RewardRequest(_ValidUnicode):
    """A session's reward: ``reward``, or ``components`` summed. Every value and the sum must be
    finite and within ``±asyncrl.wire.REWARD_BOUND`` (a sum of finite components can overflow to
    inf, which made a GRPO group's advantages NaN: issue 30)."""

    model_config = ConfigDict(extra="forbid")
    reward: float | None = Field(None, allow_inf_nan=False, ge=-REWARD_BOUND, le=REWARD_BOUND)
    components: dict[str, float] | None = Field(None, max_length=64)

    @model_validator(mode="after")
    def _something(self):
        if self.reward is None and not self.components:
            raise ValueError("give reward or components")
        for k, v in (self.components or {}).items():
            if not math.isfinite(v) or abs(v) > REWARD_BOUND:
                raise ValueError(f"component {k!r} must be finite and within ±{REWARD_BOUND:g}")
        if not math.isfinite(self.total) or abs(self.total) > REWARD_BOUND:
            raise ValueError(f"the components sum to {self.total!r}, beyond ±{REWARD_BOUND:g}")
        return self

    @property
    def total(self) -> float:
        return float(self.reward) if self.reward is not None else float(sum((self.components or {}).values()))


class FinishRequest(BaseModel):
    """The optional body of ``POST /v1/sessions/{id}/finish``: the episode failed for a reason
    that is not the model's doing (the trainer excludes it and trains the rest of its group)."""

    model_config = ConfigDict(extra="forbid")
    failure: Failure = ""
    error: str = Field("", max_length=2000)
    """What went wrong, in words (kept in the trajectory's ``reward_details.error``)."""


class ToolResultRequest(_ValidUnicode):
    model_config = ConfigDict(extra="forbid")
    tool_call_id: str = Field(min_length=1, max_length=256)
    content: str = Field(max_length=1_000_000)
    is_error: bool = False
