"""Sessions: episodes driven by external agents through the OpenAI API.

A session is an :class:`AgentState` that an outside client advances one chat completion at a
time. Contract:

- **Token identity.** The first request's messages are rendered by the chat template. Each
  later request must repeat the recorded history (the previous messages plus the assistant
  message this service returned) and may add messages; only the added messages are
  rendered — as an environment segment after the recorded tokens, loss mask 0 — so the
  tokens the engine produced are kept exactly. If the history differs (edited, shortened,
  other tools), the session starts a new *segment* from a fresh rendering and records the
  divergence in ``metadata.divergences``; the published trajectory is the last segment.
- **Exactly once.** ``finish`` writes the trajectory (id = session id) to the service's
  outbox (same path and guarantees as internal agents) and marks the session finished;
  finishing again answers the same result. Sessions are persisted in the run's sessions KV
  bucket and survive a restart of the service.
- **Expiry.** A session idle for ``api.session_ttl_s`` expires: reported (status, metric,
  log), never published; its group expects one member less (with ``publish_unit = "group"``
  the members already finished are published without it).
- **Failed.** ``finish`` with a ``failure`` publishes the episode marked untrainable; a session
  with no completion yet is closed instead (status ``failed``, nothing published), with its
  group's accounting as for an expiry.
- **Retention.** A finished or expired session is kept (``GET``, a repeated ``finish``
  answering the same result) for ``api.closed_session_retention_s`` after it closed, then
  forgotten: dropped from memory and its KV key purged (no delete marker), so memory and the
  bucket hold the open sessions plus those closed within the retention, at any run length.
  A request for a forgotten session answers 404.
- **Failed requests change nothing.** A request the engines failed (``finish_reason``
  ``error``: 400 or 503 to the client), or a streamed one the client closed before its end,
  leaves the session exactly as it was before it (:func:`snapshot` / :func:`roll_back`): no
  tokens, no divergence, no failure mark. A retry of the same request continues the same
  episode; a next request that includes the partial assistant text the client saw renders
  it as an environment segment (loss mask 0), like any message the session did not produce.
- **Auth.** Each session has its own bearer token (only its hash is stored).
- **Groups.** A session's ``group_id`` is the client's name for its group; its trajectories
  carry it as ``x:<name>`` (:data:`EXTERNAL_GROUP_PREFIX`), so an outside client can never join
  or release one of the service's own groups (``s00000001``, ...). A group's ``group_size`` is
  fixed by its first session: a join with another size is refused (409).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Any

import msgspec

from asyncrl.chat import ChatTokenizer
from asyncrl.http.errors import ApiError
from rollout_service.agent.state import AgentState, Phase
from rollout_service.openai.responses_history import StoredResponse

log = logging.getLogger(__name__)

EXPIRY_SCAN_S = 5.0  # how often idle sessions are looked for
EXTERNAL_GROUP_PREFIX = "x:"  # a session's group id on the wire: apart from the service's own groups


class SessionRecord(msgspec.Struct, kw_only=True):
    id: str
    token_hash: str
    agent: AgentState
    status: str = "open"
    created_at: float = 0.0
    last_activity: float = 0.0
    known_messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tools_key: str = ""
    last_turn_ended: bool = True
    segments: int = 1
    divergences: list[dict[str, Any]] = msgspec.field(default_factory=list)
    reward_set: bool = False
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    finished_at: float | None = None
    responses: dict[str, StoredResponse] = msgspec.field(default_factory=dict)
    """Responses API turns by response id (:mod:`.responses_history`: linear in the conversation)."""

    def public(self) -> dict[str, Any]:
        a = self.agent
        return {"id": self.id, "status": self.status, "created_at": self.created_at, "last_activity": self.last_activity,
                "group_id": a.group_id.removeprefix(EXTERNAL_GROUP_PREFIX), "group_size": a.group_size, "group_index": a.group_index, "data_source": a.data_source,
                "turns": a.assistant_turns, "tokens": len(a.token_ids), "prompt_length": a.prompt_length,
                "model_tokens": sum(a.loss_mask), "segments": self.segments, "divergences": self.divergences,
                "reward": a.reward if self.reward_set else None, "reward_details": a.reward_details,
                "version_start": a.version_start, "version_end": a.version_end, "metadata": self.metadata,
                "finished_at": self.finished_at}


_record_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(SessionRecord)


def snapshot(rec: SessionRecord) -> bytes:
    """A deep copy of ``rec`` to :func:`roll_back` to (module doc, "Failed requests")."""
    return _record_encoder.encode(rec)


def roll_back(rec: SessionRecord, snap: bytes) -> None:
    """Put every field of ``rec`` back as :func:`snapshot` saw it (in place: ``rec`` stays
    the object the session table holds)."""
    old = _record_decoder.decode(snap)
    for name in rec.__struct_fields__:
        setattr(rec, name, getattr(old, name))


def normalize_message(m: dict[str, Any]) -> dict[str, Any]:
    """Comparable form of a chat message (argument JSON canonicalised, None content = '')."""
    out: dict[str, Any] = {"role": m.get("role"), "content": m.get("content") or ""}
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", c)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        calls.append({"name": fn.get("name"), "arguments": json.dumps(args, sort_keys=True) if not isinstance(args, str) else args})
    if calls:
        out["tool_calls"] = calls
    if m.get("role") == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    return out


def tools_key(tools: list[dict] | None) -> str:
    return hashlib.sha256(json.dumps(tools or [], sort_keys=True).encode()).hexdigest()[:16]


def append_env_tokens(agent: AgentState, ids: list[int]) -> None:
    agent.token_ids.extend(ids)
    agent.loss_mask.extend([0] * len(ids))
    agent.logprobs.extend([0.0] * len(ids))
    agent.versions.extend([-1] * len(ids))


def prepare_text_turn(rec: SessionRecord, ids: list[int]) -> None:
    """Extend (or restart) the session's token sequence for a text completion of ``ids``:
    a prompt that extends the recorded tokens appends its new tokens (loss mask 0); any other
    prompt starts a new segment, recorded in ``divergences``."""
    a = rec.agent
    if a.token_ids and ids[: len(a.token_ids)] == a.token_ids and len(ids) > len(a.token_ids):
        append_env_tokens(a, ids[len(a.token_ids):])
    else:
        if a.token_ids:
            rec.segments += 1
            rec.divergences.append({"turn": a.assistant_turns, "reason": "prompt does not extend the recorded tokens",
                                    "at": time.time()})
        a.token_ids, a.loss_mask, a.logprobs, a.versions, a.sampling = list(ids), [], [], [], []
        a.version_start = a.version_end = None
        a.behaviour_logprobs, a.routed_experts = {}, None  # the old segment's, keyed by its positions
        a.prompt_length = len(ids)
    a.turn_start = len(a.token_ids)
    a.segment = 0
    a.phase = Phase.GENERATING


def record_turn(rec: SessionRecord, messages: list[dict[str, Any]], out) -> dict[str, Any]:
    """Record a successful turn's answer after ``messages`` (what the client sent); returns the
    assistant message (``out``: the turn's ``TurnOutcome``)."""
    assistant = {"role": "assistant", "content": out.content or ""}
    if out.tool_calls:
        assistant["tool_calls"] = out.tool_calls
    rec.known_messages.append(normalize_message(assistant))
    rec.agent.messages = [*messages, assistant]
    rec.last_turn_ended = out.ended_by_eos
    return assistant


def prepare_turn(rec: SessionRecord, messages: list[dict[str, Any]], chat: ChatTokenizer, key: str) -> None:
    """Extend (or restart) the session's token sequence for a new request (module doc)."""
    a = rec.agent
    incoming = [normalize_message(m) for m in messages]
    known = rec.known_messages
    reason = None
    if a.token_ids:
        if key != rec.tools_key:
            reason = "the tools changed"
        elif len(incoming) <= len(known):
            reason = f"the history has {len(incoming)} messages, {len(known)} were recorded"
        else:
            bad = next((i for i, (x, y) in enumerate(zip(incoming, known)) if x != y), None)
            if bad is not None:
                reason = f"message {bad} differs from what was recorded"
    if a.token_ids and reason is None:
        if not rec.last_turn_ended:
            append_env_tokens(a, [chat.eos_token_id])  # the turn was cut (length/stop string): close it as the template does
        append_env_tokens(a, chat.environment_segment(messages[len(known):]))
        a.user_turns += 1
    else:
        if a.token_ids:
            rec.segments += 1
            rec.divergences.append({"turn": a.assistant_turns, "reason": reason, "at": time.time()})
            a.loss_mask, a.logprobs, a.versions, a.sampling = [], [], [], []
            a.version_start = a.version_end = None
            a.behaviour_logprobs = {}  # keyed by response offset: the old segment's would land on the new tokens
            a.routed_experts = None  # the new segment's positions are computed again
        a.token_ids = chat.prompt_ids(messages)
        a.prompt_length = len(a.token_ids)
        a.messages = [dict(m) for m in messages]
    rec.tools_key = key
    rec.known_messages = incoming
    a.turn_start = len(a.token_ids)
    a.segment = 0
    a.phase = Phase.GENERATING


class SessionManager:
    """The service's sessions (see the module docstring)."""

    def __init__(self, kv, ttl_s: float, max_open: int, retention_s: float = 3600.0, forget=None, entries=None) -> None:
        """``forget(key)``: removes a key from the bucket for good (``asyncrl.jetstream.kv_forget``);
        ``entries()``: every ``(key, value)`` of the bucket, for :meth:`restore`
        (``asyncrl.jetstream.kv_listing.kv_entries``); None: nothing to restore."""
        self.kv = kv
        self._entries = entries
        self.ttl_s = ttl_s
        self.max_open = max_open
        self.retention_s = retention_s
        self._forget = forget
        self._unforgotten: set[str] = set()  # keys whose purge failed (NATS down): retried
        self.forgotten_total = 0
        self.sessions: dict[str, SessionRecord] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.expired_total = 0
        self.abandoned_streams = 0
        """Streamed session turns the client closed before the end (their partial turn dropped)."""

    @property
    def open_count(self) -> int:
        return sum(1 for s in self.sessions.values() if s.status == "open")

    def lock(self, sid: str) -> asyncio.Lock:
        return self.locks.setdefault(sid, asyncio.Lock())

    def get(self, sid: str) -> SessionRecord:
        rec = self.sessions.get(sid)
        if rec is None:
            raise ApiError(404, f"no session {sid!r}", param="session_id")
        return rec

    def add(self, rec: SessionRecord) -> None:
        self.sessions[rec.id] = rec

    @staticmethod
    def check_room(rec: SessionRecord, api, incoming: int = 0, stores_response: bool = False) -> None:
        """Refuse (400) a turn the session cannot keep (issue 67 M2): one more stored response
        beyond ``api.max_session_responses``, or a record that with the ``incoming`` request
        bytes would pass ``api.max_session_record_bytes`` (it would then silently stop being
        persisted, and be lost at a restart)."""
        if stores_response and len(rec.responses) >= api.max_session_responses:
            raise ApiError(400, f"this session stores {len(rec.responses)} responses (api.max_session_responses): "
                                "send store=false, or continue in a new session", param="store")
        size = len(msgspec.msgpack.encode(rec)) + incoming
        if size > api.max_session_record_bytes:
            raise ApiError(400, f"this session's record would grow to about {size} bytes (limit "
                                f"{api.max_session_record_bytes}, api.max_session_record_bytes): continue in a new session")

    async def save(self, rec: SessionRecord) -> None:
        try:
            await asyncio.wait_for(self.kv.put(rec.id.replace(".", "_"), msgspec.msgpack.encode(rec)), 2.0)
        except Exception as exc:  # noqa: BLE001 - NATS down: the session lives on in memory
            log.warning("session %s not persisted: %s", rec.id, exc)

    async def restore(self) -> int:
        """Load the bucket's sessions (at the service's start); returns how many are held."""
        if self._entries is None:
            return 0
        dec = msgspec.msgpack.Decoder(SessionRecord)
        for _, value in await self._entries():
            rec = dec.decode(value)
            self.sessions[rec.id] = rec
        return len(self.sessions)

    async def forget_closed(self, now: float | None = None) -> list[str]:
        """Drop sessions closed more than ``retention_s`` ago (module docstring); their ids."""
        now = time.time() if now is None else now
        gone = []
        for rec in list(self.sessions.values()):
            closed_at = max(rec.last_activity, rec.finished_at or 0.0)
            if rec.status != "open" and now - closed_at > self.retention_s and not self.lock(rec.id).locked():
                del self.sessions[rec.id]
                self.locks.pop(rec.id, None)
                self._unforgotten.add(rec.id.replace(".", "_"))
                gone.append(rec.id)
        self.forgotten_total += len(gone)
        if self._forget is not None:
            for key in list(self._unforgotten):
                try:
                    await self._forget(key)
                except Exception as exc:  # noqa: BLE001 - NATS down: retried at the next scan
                    log.warning("session %s not purged from the bucket (will retry): %s", key, exc)
                    break
                self._unforgotten.discard(key)
        return gone

    def expire_idle(self, now: float | None = None) -> list[SessionRecord]:
        now = time.time() if now is None else now
        out = []
        for rec in self.sessions.values():
            if rec.status == "open" and now - rec.last_activity > self.ttl_s and not self.lock(rec.id).locked():
                rec.status = "expired"
                self.expired_total += 1
                out.append(rec)
                log.warning("session %s expired after %.0f s idle (not published)", rec.id, now - rec.last_activity)
        return out
