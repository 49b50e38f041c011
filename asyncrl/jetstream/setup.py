"""Connecting to NATS and creating (or checking) a run's stream and KV buckets.

The run's stream (names from :class:`asyncrl.wire.NatsNames`):

- retention ``limits`` (messages stay until limits remove them, so a trainer can replay
  from its checkpointed sequence), file storage, one replica (embedded) or as configured;
- ``duplicate_window`` from ``nats.duplicate_window_s`` so ``Nats-Msg-Id`` dedup covers the
  publisher's whole retry horizon;
- ``discard=new``: a full stream rejects publishes (an error the outbox retries) instead of
  silently deleting old trajectories;
- ``max_msg_size`` that fits the largest trajectory the config allows
  (``DerivedNumbers.max_message_bytes``).

``ensure_stream`` is idempotent: it creates the stream, or updates mutable limits of an
existing one, and refuses (``StreamMismatch``) when an existing stream differs in a way that
cannot be updated in place (retention, storage). JetStream reserves a stream's ``max_bytes``
against the server's file store limit (``max_file_store``; by default 75 % of the disk's free
space when nats-server starts): a reservation that does not fit raises ``StreamStorageShort``
naming ``nats.stream_max_bytes``, the server's bare "insufficient storage resources" otherwise.

KV buckets keep history 1 and allow per-message TTLs (``allow_msg_ttl``, nats-server 2.11+). A
key that is done with is *forgotten* (:func:`kv_forget`), not deleted: a KV delete leaves a
marker message per key for ever (measured: one per finished trajectory, 4.8 k after 4.8 k
trajectories, the server's memory growing with them). Forgetting publishes a KV purge (a
rollup: every earlier message of the key goes) whose marker carries ``Nats-TTL`` and expires
``FORGET_MARKER_TTL_S`` later, so nothing of the key is left. It needs only publish rights on
``$KV.<bucket>.>`` (the rollout service's NATS user may not purge streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

import nats
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BucketNotFoundError, NotFoundError, ServerError

from asyncrl.config import RunConfig
from asyncrl.launch import port_open
from asyncrl.wire import NatsNames

log = logging.getLogger(__name__)

CONNECT_PORT_WAIT_S = 10.0  # poll the TCP port first: nats.connect() to a closed port costs ~2 s of backoff
RECONNECT_WAIT_S = 0.5  # between reconnect attempts during an outage
KV_HISTORY = 1  # agent checkpoints: only the latest state matters
FORGET_MARKER_TTL_S = 5  # a forgotten key's purge marker expires this long after (Nats-TTL, whole seconds)
JS_STORAGE_EXCEEDED = 10047  # JetStream's err_code: "insufficient storage resources available"


class StreamMismatch(RuntimeError):
    """An existing stream has settings that cannot be changed in place."""


class StreamStorageShort(RuntimeError):
    """The NATS server cannot reserve the stream's ``max_bytes`` (``nats.stream_max_bytes``)."""


@contextlib.contextmanager
def storage_refusal_named(name: str, max_bytes: int) -> Iterator[None]:
    """Within it, JetStream's storage refusal (err_code 10047) is raised as ``StreamStorageShort``
    naming ``nats.stream_max_bytes``; every other server error passes unchanged."""
    try:
        yield
    except ServerError as e:
        if e.err_code != JS_STORAGE_EXCEEDED:
            raise
        raise StreamStorageShort(
            f"NATS cannot reserve nats.stream_max_bytes={max_bytes} ({max_bytes / 2**30:.2f} GiB) for stream {name}: "
            "its JetStream file store limit has less left (max_file_store; nats-server's default, which the "
            "embedded server keeps, is 75 % of the disk's free space when it starts, less what other streams "
            "reserved). Lower nats.stream_max_bytes, or free disk space and restart nats-server; an external "
            "server can also be given a larger jetstream max_file_store"
        ) from e


async def wait_for_port(url: str, timeout_s: float = CONNECT_PORT_WAIT_S) -> None:
    """Poll the TCP port of a ``nats://`` URL until it accepts connections."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await asyncio.to_thread(port_open, host, port):
        if loop.time() > deadline:
            raise TimeoutError(f"NATS at {url} did not accept connections within {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


async def connect(url: str, name: str, user: str | None = None, password: str | None = None, persistent: bool = True) -> nats.NATS:
    """Connect with an error callback and, when ``persistent``, unlimited reconnects
    (services ride out NATS restarts; their publishers buffer in the outbox meanwhile)."""
    await wait_for_port(url)

    async def on_error(exc: Exception) -> None:
        log.warning("nats client %s: %s", name, exc)

    client: list[nats.NATS] = []

    async def on_disconnect() -> None:
        # a close of our own (or after the last reconnect) is not news; a lost connection is
        closed = bool(client) and client[0].is_closed
        log.log(logging.DEBUG if closed else logging.WARNING, "nats client %s: %s", name, "closed" if closed else "disconnected")

    async def on_reconnect() -> None:
        log.info("nats client %s: reconnected", name)

    nc = await nats.connect(
        url,
        name=name,
        user=user,
        password=password,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        max_reconnect_attempts=-1 if persistent else 3,
        reconnect_time_wait=RECONNECT_WAIT_S,
        allow_reconnect=True,
    )
    client.append(nc)
    return nc


@dataclass(frozen=True)
class StreamSettings:
    """What the run's stream is made of: the run id, ``nats.stream_max_bytes``,
    ``nats.duplicate_window_s`` and the largest message (``derived.max_message_bytes``)."""

    run_id: str
    max_bytes: int
    max_message_bytes: int
    duplicate_window_s: float

    @classmethod
    def of(cls, cfg: RunConfig) -> StreamSettings:
        return cls(cfg.run.id, cfg.nats.stream_max_bytes, cfg.derived.max_message_bytes, cfg.nats.duplicate_window_s)


def stream_config(settings: StreamSettings) -> StreamConfig:
    """The run's stream settings (see the module docstring)."""
    names = NatsNames(settings.run_id)
    return StreamConfig(
        name=names.stream,
        description=f"asyncrl trajectories of run {settings.run_id}",
        subjects=names.stream_subjects,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        max_bytes=settings.max_bytes,
        max_msg_size=settings.max_message_bytes,
        duplicate_window=settings.duplicate_window_s,
        num_replicas=1,
    )


async def ensure_stream(js: JetStreamContext, settings: StreamSettings) -> StreamConfig:
    """Create the run's stream (``StreamSettings.of(cfg)``) or reconcile an existing one; return its config."""
    wanted = stream_config(settings)
    try:
        info = await js.stream_info(wanted.name)
    except NotFoundError:
        with storage_refusal_named(wanted.name, settings.max_bytes):
            info = await js.add_stream(wanted)
        log.info("created stream %s", wanted.name)
        return info.config
    have = info.config
    if have.retention != wanted.retention or have.storage != wanted.storage:
        raise StreamMismatch(
            f"stream {wanted.name} exists with retention={have.retention} storage={have.storage}; "
            f"asyncrl needs retention={wanted.retention} storage={wanted.storage}; delete it or use another run id"
        )
    drift = {
        k: (getattr(have, k), getattr(wanted, k))
        for k in ("subjects", "discard", "max_bytes", "max_msg_size", "duplicate_window")
        if getattr(have, k) != getattr(wanted, k)
    }
    if drift:
        with storage_refusal_named(wanted.name, settings.max_bytes):
            info = await js.update_stream(wanted)
        log.info("updated stream %s: %s", wanted.name, drift)
    return info.config


async def store_sizes(js: JetStreamContext, names: NatsNames, timeout_s: float = 2.0) -> dict[str, dict[str, int]]:
    """Messages and bytes of the run's stream and KV buckets (``{"ASYNCRL_X": {...}, "KV_...": {...}}``);
    a store that does not exist (yet) or does not answer in time is left out."""
    out = {}
    for name in (names.stream, *(f"KV_{b}" for b in names.kv_buckets)):
        try:
            info = await asyncio.wait_for(js.stream_info(name), timeout_s)
        except Exception:  # noqa: BLE001 - sizes are best effort: missing store, NATS down
            continue
        out[name] = {"messages": int(info.state.messages), "bytes": int(info.state.bytes)}
    return out


async def kv_forget(js: JetStreamContext, bucket: str, key: str, timeout_s: float = 2.0,
                    marker_ttl_s: int = FORGET_MARKER_TTL_S) -> None:
    """Remove every message of ``key`` from KV ``bucket``; the purge marker itself expires after
    ``marker_ttl_s`` (module docstring). Raises on failure (callers retry)."""
    headers = {"KV-Operation": "PURGE", "Nats-Rollup": "sub", "Nats-TTL": f"{max(1, int(marker_ttl_s))}s"}
    await js.publish(f"$KV.{bucket}.{key}", b"", headers=headers, timeout=timeout_s)


async def ensure_kv(js: JetStreamContext, bucket: str, max_value_size: int = -1):
    """Open a KV bucket, creating it (file storage, history 1) when missing, with per-message
    TTLs allowed on its stream (for :func:`kv_forget`'s expiring markers)."""
    try:
        kv = await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        kv = await js.create_key_value(
            KeyValueConfig(bucket=bucket, history=KV_HISTORY, storage=StorageType.FILE, max_value_size=max_value_size)
        )
    info = await js.stream_info(f"KV_{bucket}")
    if not info.config.allow_msg_ttl:
        info.config.allow_msg_ttl = True
        await js.update_stream(info.config)
    return kv
