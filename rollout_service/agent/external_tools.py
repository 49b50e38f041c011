"""External tools: calls that internal agents park until an outside environment answers.

The broker sits beside the agent loop (which parks calls on it) and below the HTTP routes
that serve it (``rollout_service.openai.routes``: long-poll and results); it imports
neither.

When an agent calls a tool declared in ``rollout.external_tools``, the call is *parked*:
the agent holds no engine capacity (it is not counted against ``max_concurrent_samples``)
and waits for a result until the call's deadline. The call is announced

- on core NATS, subject ``asyncrl.<run>.env.<environment>``, as JSON
  ``{session_id, token, tool_call_id, name, arguments, deadline, environment}``; and
- to long-pollers: ``GET /v1/sessions/{id}/tool_calls?wait=s`` (session token) and
  ``GET /v1/environments/{env}/tool_calls?wait=s`` (data-plane token; includes each
  call's session token).

``POST /v1/sessions/{id}/tool_results {tool_call_id, content}`` answers it. Results are
idempotent by ``tool_call_id``: the same result posted again is accepted (reported as a
duplicate) and used once; a different second result is 409; an unknown call is 404; a
result after the deadline is 409. At the deadline the model gets an error result, or the
episode ends with ``finish_reason="expired"`` (``on_timeout``).

Parked calls are part of the agent's checkpoint (``PendingCall.external``/``deadline``), so a
pause, a weight sync or a restart of the service does not lose them; after a restart each
is announced again with a fresh token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from asyncrl.http.errors import ApiError
from rollout_service.api.auth import check_token, hash_token, new_token

log = logging.getLogger(__name__)

ANSWERED_KEEP = 10_000  # answered calls remembered for idempotent replays (bounded memory)


class EpisodeExpired(Exception):
    """A parked call's deadline passed and its tool says to end the episode."""


@dataclass
class ParkedCall:
    session_id: str
    call_id: str
    name: str
    arguments: dict[str, Any]
    environment: str
    deadline: float
    token_hash: str
    token: str
    on_timeout: str
    future: asyncio.Future = field(repr=False, default=None)  # type: ignore[assignment]

    def announcement(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "token": self.token, "tool_call_id": self.call_id, "name": self.name,
                "arguments": self.arguments, "deadline": self.deadline, "environment": self.environment}


class ExternalBroker:
    def __init__(self, tools: dict[str, Any], announce) -> None:
        """``tools``: name → ExternalToolConfig; ``announce(subject_env, payload_bytes)`` publishes."""
        self.tools = tools
        self.announce = announce
        self.parked: dict[tuple[str, str], ParkedCall] = {}
        self.answered: dict[tuple[str, str], str] = {}
        self.session_tokens: dict[str, str] = {}
        self._raw_tokens: dict[str, str] = {}
        self._changed = asyncio.Condition()
        self.late_results = 0
        self.expired_calls = 0

    def is_external(self, name: str) -> bool:
        return name in self.tools

    def schemas(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
                for t in self.tools.values()]

    async def call(self, session_id: str, call_id: str, name: str, arguments: dict[str, Any], deadline: float | None) -> tuple[str, bool]:
        """Park until answered; returns (content, is_error). Raises EpisodeExpired."""
        key = (session_id, call_id)
        if key in self.answered:
            return self.answered[key], False
        cfg = self.tools[name]
        token = self._raw_tokens.get(session_id)
        if token is None:  # one token per agent, shared by its parallel calls
            token = self._raw_tokens[session_id] = new_token()
            self.session_tokens[session_id] = hash_token(token)
        parked = ParkedCall(session_id, call_id, name, arguments, cfg.environment,
                            deadline if deadline is not None else time.time() + cfg.deadline_s,
                            hash_token(token), token, cfg.on_timeout, asyncio.get_running_loop().create_future())
        self.parked[key] = parked
        await self._notify()
        try:
            await self.announce(cfg.environment, json.dumps(parked.announcement()).encode())
        except Exception as exc:  # noqa: BLE001 - long-pollers still see it
            log.warning("announcing %s/%s failed: %s", session_id, call_id, exc)
        try:
            return await asyncio.wait_for(asyncio.shield(parked.future), max(0.0, parked.deadline - time.time()))
        except TimeoutError:
            self.expired_calls += 1
            if parked.on_timeout == "abort":
                raise EpisodeExpired(f"external tool {name!r} got no result before its deadline") from None
            return f"Error: the {name} environment did not answer within its deadline", True
        finally:
            self.parked.pop(key, None)
            await self._notify()

    def forget(self, session_id: str) -> None:
        """The agent finished: its token stops working (answered results stay for replays)."""
        self._raw_tokens.pop(session_id, None)
        self.session_tokens.pop(session_id, None)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def authorize(self, session_id: str, token: str | None) -> None:
        expected = self.session_tokens.get(session_id)
        if expected is None:
            raise ApiError(404, f"no session {session_id!r}", param="session_id")
        check_token(expected, token)

    def post_result(self, session_id: str, call_id: str, content: str, is_error: bool = False) -> dict[str, Any]:
        key = (session_id, call_id)
        if key in self.answered:
            if self.answered[key] == content:
                return {"accepted": True, "duplicate": True}
            raise ApiError(409, f"tool call {call_id!r} already has a different result", param="tool_call_id")
        parked = self.parked.get(key)
        if parked is None:
            raise ApiError(404, f"no pending tool call {call_id!r} in session {session_id!r}", param="tool_call_id")
        if time.time() > parked.deadline or parked.future.done():
            self.late_results += 1
            raise ApiError(409, f"tool call {call_id!r}: deadline passed at {parked.deadline:.3f}", param="tool_call_id")
        self.answered[key] = content
        while len(self.answered) > ANSWERED_KEEP:
            self.answered.pop(next(iter(self.answered)))
        parked.future.set_result((content, is_error))
        return {"accepted": True, "duplicate": False}

    async def pending(self, *, session_id: str | None = None, environment: str | None = None, wait_s: float = 0.0) -> list[dict]:
        """Parked calls of a session or an environment; waits up to ``wait_s`` for one."""
        def current() -> list[dict]:
            return [p.announcement() for p in self.parked.values()
                    if (session_id is None or p.session_id == session_id) and (environment is None or p.environment == environment)]

        deadline = time.monotonic() + wait_s
        async with self._changed:
            while not current() and time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
                except TimeoutError:
                    break
        return current()
