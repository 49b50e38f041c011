"""Token-exact chat bookkeeping for multi-turn agents.

The model's own tokens are never re-tokenised: an agent's sequence is the prompt (rendered
once by the chat template, with the tool schemas), then for each turn exactly the token ids
the engine returned, then the *environment segment* — the tokens that close the assistant
turn and wrap the tool results up to the next assistant header — rendered by the same chat
template and tokenised on its own (loss mask 0).

The environment segment is found by rendering a reference conversation twice — ending with
an assistant turn, and the same plus the tool messages and the generation prompt — and
taking the text after the assistant's end-of-turn marker. This relies on the template being
prefix-stable (appending messages only appends text); :class:`ChatTokenizer` checks that
at construction and refuses templates that are not.

Not covered: templates that rewrite earlier turns when new ones arrive (e.g. ones that drop
reasoning from previous assistant turns): they fail the prefix check with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_PROBE_USER = "ping"
_PROBE_ASSISTANT = "pong"


class TemplateError(ValueError):
    """The chat template cannot be used for token-exact multi-turn rollouts."""


class ChatTokenizer:
    """Prompt rendering, environment segments and decoding for one tokenizer."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None) -> None:
        self.tok = tokenizer
        self.tools = list(tools or []) or None
        eos = tokenizer.eos_token_id
        if eos is None:
            raise TemplateError("the tokenizer has no eos_token_id; cannot detect the end of an assistant turn")
        self.eos_token_id = int(eos)
        self.eos_text = tokenizer.convert_ids_to_tokens(self.eos_token_id)
        self._after_eos = self._text_after_assistant_eos()

    # -- rendering ----------------------------------------------------------------------
    def _render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The template's text; any failure inside the template (a tool schema or message it
        cannot handle) is a :class:`TemplateError` naming the reason."""
        try:
            return self.tok.apply_chat_template(
                list(messages), tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except TemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - jinja2 errors, TypeError, ... from user-shaped input
            raise TemplateError(f"the chat template could not render the request: {type(exc).__name__}: {exc}") from None

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a piece of template text (special tokens recognised, none added)."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The prompt: the conversation so far plus the assistant generation header."""
        return self.encode_text(self._render(messages, add_generation_prompt=True))

    def _text_after_assistant_eos(self) -> str:
        convo = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        closed = self._render(convo, add_generation_prompt=False)
        marker = _PROBE_ASSISTANT + self.eos_text
        at = closed.rfind(marker)
        if at < 0:
            raise TemplateError(
                f"the chat template does not end an assistant turn with the eos token {self.eos_text!r}; "
                "the model's stop token would not match the rendered conversation"
            )
        prompt_only = self._render(convo[:1], add_generation_prompt=True)
        if not closed.startswith(prompt_only):
            raise TemplateError("the chat template is not prefix-stable: rendering a longer conversation changed earlier text")
        return closed[at + len(marker):]

    def environment_segment(self, tool_messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Tokens that follow the model's end-of-turn token: the rest of the assistant turn's
        closing text, the tool/user turn(s) and (by default) the next assistant header."""
        convo = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        before = self._render(convo, add_generation_prompt=False)
        after = self._render([*convo, *tool_messages], add_generation_prompt=add_generation_prompt)
        if not after.startswith(before):
            raise TemplateError("the chat template is not prefix-stable for tool messages")
        return self.encode_text(self._after_eos + after[len(before):])

    # -- decoding -----------------------------------------------------------------------
    def decode_turn(self, ids: Sequence[int]) -> str:
        """The text of one assistant turn: special tool tags kept, the end-of-turn token removed."""
        body = list(ids)
        if body and body[-1] == self.eos_token_id:
            body = body[:-1]
        return self.tok.decode(body, skip_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def truncate_text_to_tokens(self, text: str, max_tokens: int) -> str:
        """``text`` cut to at most ``max_tokens`` tokens (with a marker when cut)."""
        ids = self.encode_text(text)
        if len(ids) <= max_tokens:
            return text
        return self.tok.decode(ids[:max_tokens], skip_special_tokens=False) + " …[truncated]"
