"""Anthropic's Messages API request, lowered onto a Chat Completions request (issue 52).

A ``POST .../v1/messages`` body is validated here (:class:`MessagesRequest`) and lowered
(:func:`lower_messages`) to the :class:`~rollout_service.openai.schemas.ChatCompletionRequest`
the one turn loop serves, so a Messages turn records exactly the tokens a Chat turn would.

Lowering:

- ``system`` (a string or ``text`` blocks) → a leading ``system`` message;
- ``messages``: ``user`` / ``assistant`` (/ ``system``) turns whose ``content`` is a string or
  blocks: ``text`` (several joined by a blank line); in an assistant turn ``tool_use`` (``id``,
  ``name``, ``input``) → the assistant message's tool calls (arguments = ``input`` as JSON); in a
  user turn ``tool_result`` (``tool_use_id``, ``content`` a string or blocks, ``is_error``) → a
  ``tool`` message (an error result's text is prefixed ``Error: ``; a non-text block in it, an
  image a tool returned, becomes the text ``[image]`` (or its type): the policy reads text, and
  an agent loop must not die on a screenshot in its history), its text blocks → a user
  message after them. A ``tool_result`` whose ``tool_use_id`` no earlier ``tool_use`` made is
  refused.
- ``tools`` (client tools: ``name``, ``description``, ``input_schema``) → function tools;
  ``tool_choice`` ``auto`` / ``any`` (→ ``required``) / ``tool`` (→ that function) / ``none``,
  ``disable_parallel_tool_use`` → ``parallel_tool_calls = false``;
- ``max_tokens`` (required, as Anthropic requires it; above ``api.max_tokens`` it is lowered to
  it: a cap, not a demand), ``stop_sequences``; ``temperature``
  (Anthropic's range, 0-1) and ``top_p`` where a client sends them (recent ``anthropic``
  clients have no such arguments: ``extra_body``).

Refused with a 400 naming them, never ignored: server tools (any tool with a ``type`` other
than ``custom``: ``web_search_*``, ``bash_*``, ``text_editor_*``, ``computer_*``, ...), blocks
other than the above (``image``, ``document``, ``thinking``, ``redacted_thinking``,
``server_tool_use``, ...) outside a tool result, ``thinking`` enabled with a budget, ``top_k``, ``container``, ``mcp_servers``,
``output_config`` (output formats), ``service_tier`` other than ``auto``. Accepted without
effect on the tokens: ``thinking`` ``adaptive`` (answered without thinking blocks), a client
tool's ``strict``, ``defer_loading``, ``input_examples``, ``allowed_callers``,
``eager_input_streaming``, ``model``, ``metadata``, ``cache_control`` (top level and on blocks: the
engines' prefix cache is automatic), ``diagnostics`` (answered without cache diagnostics),
``inference_geo``, ``speed``, ``user_profile_id``, ``workspace_id``; ``stream`` (the route
decides).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.http.errors import ApiError
from rollout_service.openai.schemas import ChatCompletionRequest, _ValidUnicode

UNSUPPORTED = ("top_k", "container", "mcp_servers", "context_management", "output_config")
MAX_MESSAGES = 4096


class ClientTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    # accepted, no effect here (grammar-constrained calls, tool search, examples, callers)
    strict: bool | None = None
    defer_loading: bool | None = None
    input_examples: list[Any] | None = None
    allowed_callers: list[Any] | None = None
    eager_input_streaming: bool | None = None


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_ValidUnicode):
    """The supported subset of Anthropic's ``POST /v1/messages`` (module docstring)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    # accepted, no effect on the tokens: prompt-cache hints, routing and attribution
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="after")
    def _refuse_what_is_not_supported(self):
        extra = dict(self.model_extra or {})
        for key in UNSUPPORTED:
            value = extra.pop(key, None)
            if value not in (None, [], {}):
                raise ValueError(f"parameter {key!r} is not supported by asyncrl")
        if extra:
            raise ValueError(f"unsupported parameter(s): {', '.join(sorted(extra))}")
        if self.thinking is not None and self.thinking.get("type") not in ("disabled", "adaptive"):
            raise ValueError("thinking: extended thinking with a budget is not supported (omit it, or send "
                             "{'type': 'disabled'} or {'type': 'adaptive'}: answered without thinking blocks)")
        if self.service_tier not in (None, "auto", "standard_only"):
            raise ValueError(f"service_tier {self.service_tier!r} is not supported")
        return self

    @field_validator("tools")
    @classmethod
    def _client_tools_only(cls, v):
        for i, tool in enumerate(v or []):
            kind = tool.get("type")
            if kind not in (None, "custom"):
                raise ValueError(f"tools[{i}]: server tool {kind!r} is not supported (declare a client tool with input_schema)")
            ClientTool.model_validate(tool)
        return v


BLOCK_SEPARATOR = "\n\n"  # between text blocks of one message (a system prompt in sections, reminders)


def _text_blocks(content: Any, where: str, placeholders: bool = False) -> str:
    """The text of ``content``; ``placeholders``: a non-text block (a tool's image) becomes
    ``[its type]`` instead of a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            continue
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if placeholders and isinstance(kind, str):
            texts.append(f"[{kind}]")
            continue
        raise ApiError(400, f"{where}[{j}]: {kind!r} blocks are not supported here (text only)", param=where)
    return BLOCK_SEPARATOR.join(texts)


def _assistant(content: Any, where: str, known: set[str]) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text, calls = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use":
            tid, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(tid, str) or not tid or not isinstance(name, str) or not name or not isinstance(args, dict):
                raise ApiError(400, f"{at}: a tool_use block needs a string id and name and an object input", param=at)
            calls.append({"id": tid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}})
            known.add(tid)
        else:
            raise ApiError(400, f"{at}: {kind!r} blocks are not supported in an assistant turn (text and tool_use)", param=at)
    message: dict[str, Any] = {"role": "assistant", "content": BLOCK_SEPARATOR.join(text)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(content: Any, where: str, known: set[str]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results, text = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_result":
            tid = block.get("tool_use_id")
            if not isinstance(tid, str) or tid not in known:
                raise ApiError(400, f"{at}: tool_result for tool_use_id {tid!r}, which no earlier tool_use made", param=at)
            output = _text_blocks(block.get("content", ""), f"{at}.content", placeholders=True)
            results.append({"role": "tool", "tool_call_id": tid,
                            "content": f"Error: {output}" if block.get("is_error") else output})
        else:
            raise ApiError(400, f"{at}: {kind!r} blocks are not supported in a user turn (text and tool_result)", param=at)
    return results + ([{"role": "user", "content": BLOCK_SEPARATOR.join(text)}] if text or not results else [])


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ApiError(400, "tool_choice: only {'type': 'auto'}, {'type': 'any'}, {'type': 'none'} or {'type': 'tool', 'name': ...}",
                   param="tool_choice")


def lower_messages(req: MessagesRequest, max_tokens_cap: int | None = None) -> ChatCompletionRequest:
    """The Chat Completions request that serves ``req`` (module docstring); ``max_tokens_cap``:
    ``api.max_tokens``, what ``max_tokens`` is lowered to when above it."""
    system = _text_blocks(req.system, "system") if req.system is not None else ""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    known: set[str] = set()
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role == "system":
            messages.append({"role": "system", "content": _text_blocks(m.content, f"{where}.content")})
        else:
            messages += [_assistant(m.content, where, known)] if m.role == "assistant" else _user(m.content, where, known)
    tools = [{"type": "function", "function": {k: v for k, v in (("name", t["name"]), ("description", t.get("description")),
                                                                 ("parameters", t["input_schema"])) if v is not None}}
             for t in req.tools or []]
    choice, parallel = _tool_choice(req.tool_choice)
    body = {"model": req.model, "messages": messages, "tools": tools or None, "tool_choice": choice,
            "parallel_tool_calls": parallel, "temperature": req.temperature, "top_p": req.top_p,
            "max_tokens": min(req.max_tokens, max_tokens_cap) if max_tokens_cap else req.max_tokens,
            "stop": req.stop_sequences or None}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValueError as exc:  # pydantic's, naming the field of the lowered request
        raise ApiError(400, f"invalid request: {exc}") from None
