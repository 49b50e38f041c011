"""The OpenAI Responses API's request, lowered onto a Chat Completions request (issue 52).

A ``POST .../v1/responses`` body is validated here (:class:`ResponsesRequest`) and lowered
(:func:`lower`) to the :class:`~rollout_service.openai.schemas.ChatCompletionRequest` the one
turn loop already serves, so a Responses turn records exactly the tokens a Chat turn would.

Lowering:

- ``instructions`` → a leading ``system`` message (the Responses API does not carry
  instructions over ``previous_response_id``: each request's own apply);
- ``input`` as a string → one ``user`` message; as items: ``message`` (``role`` user, system,
  developer or assistant; ``content`` a string or ``input_text`` / ``output_text`` parts),
  ``function_call`` (``call_id``, ``name``, ``arguments``) → an assistant message's tool call
  (calls right after an assistant message, or after each other, join that one message: a
  response's output items — its text, then its calls — are one model turn),
  ``function_call_output`` (``call_id``, ``output``) → a ``tool`` message; a
  ``function_call_output`` whose ``call_id`` no earlier call made is refused;
- ``previous`` (the conversation a ``previous_response_id`` names, already as chat messages)
  goes before the input;
- ``tools`` (``function`` only: ``name``, ``description``, ``parameters``, ``strict``),
  ``tool_choice`` (``auto`` / ``none`` / ``required`` / ``{"type": "function", "name"}``),
  ``parallel_tool_calls``, ``temperature``, ``top_p``, ``max_output_tokens``.

Refused with a 400 naming them, never ignored: hosted tools (``web_search``, ``file_search``,
``computer_use_preview``, ``code_interpreter``, ``mcp``, ``image_generation``, ...), item types
other than the three above (``reasoning``, ``file_search_call``, images and files as input
parts), ``background``, ``reasoning``, ``include``, a ``text.format`` other than plain text,
``truncation`` other than ``disabled``, ``prompt`` templates, ``conversation``. Accepted and
echoed: ``model``, ``store``, ``metadata``, ``user``, ``stream`` (the route decides).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.http.errors import ApiError
from rollout_service.openai.schemas import ChatCompletionRequest, _ValidUnicode

UNSUPPORTED = ("background", "reasoning", "include", "prompt", "conversation", "max_tool_calls", "top_logprobs",
               "service_tier", "prompt_cache_key", "safety_identifier", "stream_options")
ITEM_TYPES = ("message", "function_call", "function_call_output")
MAX_ITEMS = 4096


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


class ResponsesRequest(_ValidUnicode):
    """The supported subset of ``POST /v1/responses`` (module docstring)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None

    @model_validator(mode="after")
    def _refuse_what_is_not_supported(self):
        extra = dict(self.model_extra or {})
        for key in UNSUPPORTED:
            value = extra.pop(key, None)
            if value not in (None, False, [], {}):
                raise ValueError(f"parameter {key!r} is not supported by asyncrl")
        if extra:
            raise ValueError(f"unsupported parameter(s): {', '.join(sorted(extra))}")
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if set(self.text or {}) - {"format", "verbosity"} or fmt.get("type") != "text":
            raise ValueError("text: only the plain text format is supported (no json_schema or json_object)")
        if self.truncation not in (None, "disabled"):
            raise ValueError(f"truncation {self.truncation!r} is not supported (only 'disabled')")
        if isinstance(self.input, list) and len(self.input) > MAX_ITEMS:
            raise ValueError(f"input has {len(self.input)} items (limit {MAX_ITEMS})")
        return self

    @field_validator("metadata")
    @classmethod
    def _metadata_as_openai_bounds_it(cls, v):
        """OpenAI's bounds (issue 67 M2: each stored response echoes it): at most 16 pairs, keys
        of at most 64 characters, values of at most 512."""
        if v is None:
            return v
        if len(v) > METADATA_PAIRS:
            raise ValueError(f"metadata has {len(v)} pairs (limit {METADATA_PAIRS})")
        for key, value in v.items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(f"metadata key {key[:20]!r}... has {len(key)} characters (limit {METADATA_KEY_CHARS})")
            if len(value) > METADATA_VALUE_CHARS:
                raise ValueError(f"metadata value of {key!r} has {len(value)} characters (limit {METADATA_VALUE_CHARS})")
        return v

    @field_validator("tools")
    @classmethod
    def _function_tools_only(cls, v):
        for i, tool in enumerate(v or []):
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(f"tools[{i}]: {kind!r} tools are not supported (hosted tools are not; declare a function)")
            FunctionTool.model_validate(tool)
        return v


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"{where}.content[{j}]: {kind!r} parts are not supported (text only)", param=f"{where}.content")
        texts.append(part["text"])
    return "".join(texts)


def lower_items(items: str | list[dict[str, Any]], known_calls: set[str]) -> list[dict[str, Any]]:
    """``input`` as chat messages (module docstring); ``known_calls``: call ids already made in
    the conversation before (a ``previous_response_id``'s), extended with this input's."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"{where}.role must be user, system, developer or assistant, not {role!r}", param=f"{where}.role")
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content", ""), where)})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name or not isinstance(arguments, str):
                raise ApiError(400, f"{where}: a function_call needs string call_id, name and arguments", param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the calls of the message just before (one model turn)
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            known_calls.add(call_id)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or call_id not in known_calls:
                raise ApiError(400, f"{where}: function_call_output for call_id {call_id!r}, which no earlier function_call made",
                               param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(output if output is not None else "", where)})
        else:
            raise ApiError(400, f"{where}: item type {kind!r} is not supported ({', '.join(ITEM_TYPES)})", param=f"{where}.type")
    return out


def lower(req: ResponsesRequest, previous: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    """The Chat Completions request that serves ``req`` (module docstring); ``previous``: the
    chat messages of the response ``previous_response_id`` names (its inputs and outputs, without
    the ``instructions`` of earlier turns: those do not carry over)."""
    history = list(previous or [])
    known = {c["id"] for m in history for c in m.get("tool_calls") or []}
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    messages += lower_items(req.input, known)
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}}
             for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, "tool_choice: only 'auto', 'none', 'required' or {'type': 'function', 'name': ...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    body = {"model": req.model, "messages": messages, "tools": tools or None, "tool_choice": choice,
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
            "max_tokens": req.max_output_tokens}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValueError as exc:  # pydantic's, naming the field of the lowered request
        raise ApiError(400, f"invalid request: {exc}") from None
