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

``POST /v1/sessions/{id}/tool_results {tool_call_id, content, is_error}`` answers it, with
the call's token. Every call has a :class:`CallRecord` (status ``parked`` → ``answered`` or
``expired``), written to the run's calls KV bucket (``store``) *before* a result is
acknowledged, and kept until ``retention_s`` after the later of its deadline and its
answer, whatever happened to the agent meanwhile (finished, restarted). For that long, a
retry gets the same answer:

- the same result again (content and ``is_error``) → 200 ``{"accepted": true, "duplicate": true}``,
  used once;
- a different result → 409; a result after the deadline → 409;
- an unknown call (never parked, or forgotten after the retention) → 404 when the token is
  valid for a call of that session still on record, else 403, like a wrong token: the answer
  never tells a prober which session ids exist.

A result accepted while the service then crashed is not lost: the agent, restored from its
checkpoint, parks the call again and finds the answered record (restored from the bucket by
:meth:`ExternalBroker.restore`). After a restart a still-parked call is announced again with
a fresh token; the tokens handed out before stay valid for it.

At the deadline the model gets an error result, or the episode ends with
``finish_reason="expired"`` (``on_timeout``). ``is_error`` travels with the result into the
tool message (``is_error`` key) and so into the trajectory's ``messages`` and the reward's
context (``rollout_service.service``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from asyncrl.http.errors import ApiError
from asyncrl.http.session_tokens import check_token, hash_token, new_token
from asyncrl.wire.environment import ToolCallAnnouncement

log = logging.getLogger(__name__)

RETENTION_S = 600.0  # default: records outlive the later of deadline and answer by this much


class EpisodeExpired(Exception):
    """A parked call's deadline passed and its tool says to end the episode."""


class CallRecord(msgspec.Struct, kw_only=True):
    """What is known about one external call (module docstring); persisted as MessagePack."""

    session_id: str
    call_id: str
    name: str
    environment: str
    deadline: float
    token_hashes: list[str] = msgspec.field(default_factory=list)
    status: str = "parked"  # parked | answered | expired
    content: str | None = None
    is_error: bool = False
    closed_at: float | None = None

    @property
    def key(self) -> str:
        return record_key(self.session_id, self.call_id)

    def forget_after(self, retention_s: float) -> float:
        return max(self.deadline, self.closed_at or 0.0) + retention_s


def record_key(session_id: str, call_id: str) -> str:
    """A legal KV key, distinct for distinct ``(session_id, call_id)`` pairs."""
    return hashlib.sha256(f"{session_id}\0{call_id}".encode()).hexdigest()[:40]


class RecordStore(Protocol):
    """Durable key → bytes (the run's calls KV bucket); every method may raise when NATS is down."""

    async def put(self, key: str, value: bytes) -> None: ...
    async def forget(self, key: str) -> None: ...
    async def load_all(self) -> list[bytes]: ...


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(CallRecord)


@dataclass
class ParkedCall:
    session_id: str
    call_id: str
    name: str
    arguments: dict[str, Any]
    environment: str
    deadline: float
    token: str
    on_timeout: str
    future: asyncio.Future = field(repr=False, default=None)  # type: ignore[assignment]

    def announcement(self) -> ToolCallAnnouncement:
        return ToolCallAnnouncement(session_id=self.session_id, token=self.token, tool_call_id=self.call_id, name=self.name,
                                    arguments=self.arguments, deadline=self.deadline, environment=self.environment)


class ExternalBroker:
    def __init__(self, tools: dict[str, Any], announce, store: RecordStore | None = None,
                 retention_s: float = RETENTION_S) -> None:
        """``tools``: name → ExternalToolConfig; ``announce(subject_env, payload_bytes)`` publishes;
        ``store``: where call records persist (None: memory only, e.g. in unit tests)."""
        self.tools = tools
        self.announce = announce
        self.store = store
        self.retention_s = retention_s
        self.parked: dict[tuple[str, str], ParkedCall] = {}
        self.records: dict[tuple[str, str], CallRecord] = {}
        self.session_tokens: dict[str, str] = {}
        self._raw_tokens: dict[str, str] = {}
        self._changed = asyncio.Condition()
        self.late_results = 0
        self.expired_calls = 0
        self.store_failures = 0

    def is_external(self, name: str) -> bool:
        return name in self.tools

    def schemas(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
                for t in self.tools.values()]

    # -- persistence -----------------------------------------------------------------------
    async def _save(self, rec: CallRecord) -> bool:
        if self.store is None:
            return True
        try:
            await self.store.put(rec.key, _enc.encode(rec))
            return True
        except Exception as exc:  # noqa: BLE001 - NATS down: the record lives on in memory
            self.store_failures += 1
            log.warning("call record %s/%s not written: %s", rec.session_id, rec.call_id, exc)
            return False

    async def restore(self) -> int:
        """Load the records of the run (before agents restart); returns how many."""
        if self.store is None:
            return 0
        for raw in await self.store.load_all():
            try:
                rec = _dec.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("unreadable call record skipped: %s", exc)
                continue
            self.records[(rec.session_id, rec.call_id)] = rec
        return len(self.records)

    async def sweep(self, now: float | None = None) -> int:
        """Forget records past their retention (memory and bucket); returns how many."""
        now = time.time() if now is None else now
        old = [k for k, r in self.records.items() if k not in self.parked and r.forget_after(self.retention_s) < now]
        for k in old:
            rec = self.records.pop(k)
            if self.store is not None:
                try:
                    await self.store.forget(rec.key)
                except Exception as exc:  # noqa: BLE001 - retried at the next sweep
                    self.records[k] = rec
                    log.warning("call record %s/%s not purged (will retry): %s", rec.session_id, rec.call_id, exc)
        return len(old)

    # -- the agent's side ------------------------------------------------------------------
    async def call(self, session_id: str, call_id: str, name: str, arguments: dict[str, Any], deadline: float | None) -> tuple[str, bool]:
        """Park until answered; returns (content, is_error). Raises EpisodeExpired."""
        key = (session_id, call_id)
        rec = self.records.get(key)
        if rec is not None and rec.status == "answered":  # answered before a restart or a pause
            return rec.content or "", rec.is_error
        cfg = self.tools[name]
        token = self._raw_tokens.get(session_id)
        if token is None:  # one token per agent, shared by its parallel calls
            token = self._raw_tokens[session_id] = new_token()
            self.session_tokens[session_id] = hash_token(token)
        due = deadline if deadline is not None else time.time() + cfg.deadline_s
        if rec is None:
            rec = self.records[key] = CallRecord(session_id=session_id, call_id=call_id, name=name,
                                                 environment=cfg.environment, deadline=due)
        if hash_token(token) not in rec.token_hashes:
            rec.token_hashes.append(hash_token(token))
        await self._save(rec)
        parked = ParkedCall(session_id, call_id, name, arguments, cfg.environment, rec.deadline, token, cfg.on_timeout,
                            asyncio.get_running_loop().create_future())
        self.parked[key] = parked
        await self._notify()
        try:
            await self.announce(cfg.environment, parked.announcement().encode())
        except Exception as exc:  # noqa: BLE001 - long-pollers still see it
            log.warning("announcing %s/%s failed: %s", session_id, call_id, exc)
        try:
            return await asyncio.wait_for(asyncio.shield(parked.future), max(0.0, parked.deadline - time.time()))
        except TimeoutError:
            self.expired_calls += 1
            if rec.status == "parked":
                rec.status, rec.closed_at = "expired", time.time()
                await self._save(rec)
            if parked.on_timeout == "abort":
                raise EpisodeExpired(f"external tool {name!r} got no result before its deadline") from None
            return f"Error: the {name} environment did not answer within its deadline", True
        finally:
            self.parked.pop(key, None)
            await self._notify()

    def forget(self, session_id: str) -> None:
        """The agent finished: its token stops listing calls (its call records stay, with their
        tokens, for replays until their retention ends)."""
        self._raw_tokens.pop(session_id, None)
        self.session_tokens.pop(session_id, None)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- the environment's side ------------------------------------------------------------
    def authorize(self, session_id: str, token: str | None) -> None:
        """For listing a live agent's parked calls: its current token."""
        expected = self.session_tokens.get(session_id)
        if expected is None:
            raise ApiError(404, f"no session {session_id!r}", param="session_id")
        check_token(expected, token)

    async def post_result(self, session_id: str, call_id: str, content: str, is_error: bool, token: str | None) -> dict[str, Any]:
        """Answer a call (module docstring); the record is written before the answer is given."""
        key = (session_id, call_id)
        if token is None:
            check_token("", None)  # 401: the token is missing, whatever the call
        rec = self.records.get(key)
        if rec is None:  # the token is checked first: a 404 would tell a prober which sessions exist
            hashes = [h for (s, _), r in self.records.items() if s == session_id for h in r.token_hashes]
            if not any(hmac.compare_digest(hash_token(token), h) for h in hashes):
                raise ApiError(403, f"invalid session token, or no session {session_id!r} with external tool calls "
                                    f"(forgotten {self.retention_s:.0f} s after they closed)")
            raise ApiError(404, f"no tool call {call_id!r} in session {session_id!r}", param="tool_call_id")
        if not any(hmac.compare_digest(hash_token(token), h) for h in rec.token_hashes):
            raise ApiError(403, "invalid session token")
        if rec.status == "answered":
            if rec.content == content and rec.is_error == is_error:
                return {"accepted": True, "duplicate": True}
            raise ApiError(409, f"tool call {call_id!r} already has a different result", param="tool_call_id")
        if rec.status == "expired" or time.time() > rec.deadline:
            self.late_results += 1
            raise ApiError(409, f"tool call {call_id!r}: deadline passed at {rec.deadline:.3f}", param="tool_call_id")
        rec.status, rec.content, rec.is_error, rec.closed_at = "answered", content, is_error, time.time()
        await self._save(rec)
        parked = self.parked.get(key)
        if parked is not None and not parked.future.done():
            parked.future.set_result((content, is_error))
        return {"accepted": True, "duplicate": False}

    async def pending(self, *, session_id: str | None = None, environment: str | None = None, wait_s: float = 0.0) -> list[dict]:
        """Parked calls of a session or an environment; waits up to ``wait_s`` for one."""
        def current() -> list[dict]:
            return [msgspec.to_builtins(p.announcement()) for k, p in self.parked.items()
                    if (session_id is None or p.session_id == session_id) and (environment is None or p.environment == environment)
                    and self.records.get(k, None) is not None and self.records[k].status == "parked"]

        deadline = time.monotonic() + wait_s
        async with self._changed:
            while not current() and time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
                except TimeoutError:
                    break
        return current()

