"""Checkpoints of agents and of the runner in the run's JetStream KV buckets.

``AgentStore`` keeps one key per live trajectory (its id, with ``.`` replaced) in the
agents bucket, holding the MessagePack of its :class:`AgentState`; a finished trajectory's
key is forgotten (``asyncrl.jetstream.kv_forget``: no delete marker stays), so the bucket
holds the live agents only, whatever the run's length; ``RunnerStateStore``
keeps the prompt-stream cursor, the quota counters and the weight version in the state
bucket. Writes are best effort with a timeout: while NATS is unreachable a failed write is
remembered and the newest state is written at the next opportunity (``flush_dirty``), so an
outage never blocks rollouts; what a crash during an outage loses is the progress since the
last successful write (the agent is then resumed from its older checkpoint).
"""

from __future__ import annotations

import asyncio
import logging
import re

import msgspec
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from asyncrl.jetstream.kv_listing import kv_entries
from asyncrl.jetstream.setup import kv_forget
from rollout_service.agent.state import AgentState, decode_state, encode_state

log = logging.getLogger(__name__)

KV_TIMEOUT_S = 2.0  # one KV write; NATS answers in ~1 ms when healthy
_KEY_SAFE = re.compile(r"[^A-Za-z0-9_=-]")


def kv_key(trajectory_id: str) -> str:
    """A legal KV key for a trajectory id (``.``/``:`` and friends become ``_``)."""
    return _KEY_SAFE.sub("_", trajectory_id)


class AgentStore:
    def __init__(self, kv: KeyValue, js: JetStreamContext, bucket: str) -> None:
        self.kv = kv
        self.js, self.bucket = js, bucket
        self._dirty: dict[str, AgentState] = {}
        self._pending_deletes: set[str] = set()
        self.write_failures = 0

    async def put(self, state: AgentState) -> bool:
        """Write ``state``; on failure remember it for :meth:`flush_dirty`."""
        try:
            await asyncio.wait_for(self.kv.put(kv_key(state.id), encode_state(state)), KV_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - NATS down, timeouts: retried later
            self.write_failures += 1
            self._dirty[state.id] = state
            log.warning("agent checkpoint %s not written (will retry): %s", state.id, exc)
            return False
        self._dirty.pop(state.id, None)
        return True

    async def delete(self, trajectory_id: str) -> bool:
        """Forget a finished agent; a failed delete is retried by :meth:`flush_dirty`."""
        self._dirty.pop(trajectory_id, None)
        try:
            await kv_forget(self.js, self.bucket, kv_key(trajectory_id), KV_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            self._pending_deletes.add(trajectory_id)
            log.warning("agent checkpoint %s not deleted (will retry): %s", trajectory_id, exc)
            return False
        self._pending_deletes.discard(trajectory_id)
        return True

    @property
    def pending(self) -> int:
        """Writes and deletes waiting for NATS."""
        return len(self._dirty) + len(self._pending_deletes)

    async def flush_dirty(self) -> int:
        """Retry failed writes and deletes; return how many are still pending."""
        for state in list(self._dirty.values()):
            await self.put(state)
        for trajectory_id in list(self._pending_deletes):
            await self.delete(trajectory_id)
        return self.pending

    async def load_all(self) -> list[AgentState]:
        """Every checkpointed agent (undecodable entries are logged and skipped)."""
        states = []
        for key, value in await kv_entries(self.js, self.bucket):
            try:
                states.append(decode_state(value))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("agent checkpoint %s is unreadable, skipped: %s", key, exc)
        return states


class KvRecords:
    """Raw key → bytes in a KV bucket, for records that need no history (external call
    records: ``rollout_service.agent.external_tools.RecordStore``). Every call may raise."""

    def __init__(self, kv: KeyValue, js: JetStreamContext, bucket: str) -> None:
        self.kv, self.js, self.bucket = kv, js, bucket

    async def put(self, key: str, value: bytes) -> None:
        await asyncio.wait_for(self.kv.put(key, value), KV_TIMEOUT_S)

    async def forget(self, key: str) -> None:
        await kv_forget(self.js, self.bucket, key, KV_TIMEOUT_S)

    async def load_all(self) -> list[bytes]:
        return [value for _, value in await kv_entries(self.js, self.bucket)]


class RunnerStateStore:
    """Small JSON documents of the runner (stream cursor, quota, version) in a KV bucket."""

    def __init__(self, kv: KeyValue, service_key: str = "rollout") -> None:
        self.kv = kv
        self.key = f"{service_key}_runner"
        self.write_failures = 0

    async def save(self, doc: dict) -> bool:
        try:
            await asyncio.wait_for(self.kv.put(self.key, msgspec.json.encode(doc)), KV_TIMEOUT_S)
            return True
        except Exception as exc:  # noqa: BLE001
            self.write_failures += 1
            log.warning("runner state not written (will retry): %s", exc)
            return False

    async def load(self) -> dict | None:
        try:
            entry = await self.kv.get(self.key)
        except Exception as exc:  # noqa: BLE001 - KeyNotFoundError on a fresh run
            if type(exc).__name__ in ("KeyNotFoundError", "KeyDeletedError"):
                return None
            raise
        return msgspec.json.decode(entry.value) if entry.value else None
