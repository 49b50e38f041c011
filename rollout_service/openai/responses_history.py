"""What a session keeps of its Responses API turns (issue 52): per response id, the response
object ``GET .../v1/responses/{id}`` returns and just enough of its conversation for a later
``previous_response_id`` to continue it.

A response stores its parent (the ``previous_response_id`` it continued, or None) and only the
chat messages it added: its new input (without ``instructions``, which do not carry over) and
its answer (a ``developer`` input message stays: only ``instructions`` do not carry
over). The conversation of a response is its chain of parents' additions followed by its
own, so a session of n chained turns stores each message once (linear in the conversation,
where a copy of the whole conversation per response grew quadratically in the session's saved
record). Chains may branch (two responses continuing the same parent); the session's token
sequence then restarts as for any other history change (``segments``)."""

from __future__ import annotations

from typing import Any

import msgspec


class StoredResponse(msgspec.Struct, kw_only=True):
    parent: str | None
    added: list[dict[str, Any]]
    object: dict[str, Any]


def conversation(responses: dict[str, StoredResponse], response_id: str) -> list[dict[str, Any]] | None:
    """The chat messages (no ``instructions``) through the answer of ``response_id``; None when
    the session has no such response. A parent that is missing ends the walk (cannot happen in
    a session's own records: a response is kept only after its parent was)."""
    parts: list[list[dict[str, Any]]] = []
    seen: set[str] = set()
    current: str | None = response_id
    while current is not None and current not in seen:
        stored = responses.get(current)
        if stored is None:
            if current == response_id:
                return None
            break
        seen.add(current)
        parts.append(stored.added)
        current = stored.parent
    return [m for part in reversed(parts) for m in part]


def remember(responses: dict[str, StoredResponse], response_id: str, parent: str | None, new_input: list[dict[str, Any]],
             answer: dict[str, Any], obj: dict[str, Any]) -> None:
    """Keep ``response_id``: ``new_input`` is the turn's input as chat messages (after the
    ``instructions`` and the parent's conversation), ``answer`` its assistant message."""
    responses[response_id] = StoredResponse(parent=parent, added=[*new_input, answer], object=obj)
