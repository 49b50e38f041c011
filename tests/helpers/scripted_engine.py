"""Scripted engine answers for tests whose point is not what a model generates: a
:class:`~tests.helpers.recording_proxy.RecordingProxy` ``intercept`` that answers ``/generate``
with a chosen text, in SGLang's response shape, instead of forwarding to the engine.

``scripted_generate(chat, answer, log)``: ``answer(prompt_text)`` returns the completion text
(EOS is appended) or None to forward the request to the real engine. Every scripted answer is
appended to ``log`` as ``(request body, response)`` so a test can compare what the service
published with exactly what "the engine" returned. Logprobs are a constant -0.5 per token.
Not covered: streamed ``/generate`` requests (forwarded as they are).
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.chat import ChatTokenizer

LOGPROB = -0.5


def generate_answer(chat: ChatTokenizer, body: dict, ids: list[int]) -> dict:
    """SGLang's /generate answer of ``ids`` (already ending with EOS, when it ends the turn)."""
    return {"text": chat.decode(ids), "output_ids": ids, "meta_info": {
        "id": body.get("rid", ""), "finish_reason": {"type": "stop", "matched": chat.eos_token_id},
        "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids), "cached_tokens": 0,
        "output_token_logprobs": [[LOGPROB, t, None] for t in ids], "weight_version": "default"}}


def scripted_generate(chat: ChatTokenizer, answer: Callable[[str], str | None], log: list | None = None):
    def intercept(method, path, body):
        if path != "/generate" or not isinstance(body, dict) or body.get("stream") or "input_ids" not in body:
            return None
        text = answer(chat.decode(body["input_ids"]))
        if text is None:
            return None
        resp = generate_answer(chat, body, chat.encode_text(text) + [chat.eos_token_id])
        if log is not None:
            log.append((body, resp))
        return 200, resp

    return intercept
