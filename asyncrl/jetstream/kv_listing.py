"""Every live key of a KV bucket with its value, listed from a server-side snapshot.

nats-py's ``KeyValue.keys()`` lists keys through a push watcher and decides it has seen them
all when the server's consumer info reports nothing pending while the client has not yet read
a message. The consumer's deliveries and that reply travel separately, so on a loaded machine
the reply can win the race: ``keys()`` then ends early and misses keys, or raises
``NoKeysError`` on a full bucket (others have met it too). A restore built on it restores
part of the state and says nothing — agents, sessions or external call records lost at a
restart. :func:`kv_entries` asks instead for the bucket stream's subjects
(``STREAM.INFO`` with a subjects filter: one reply, counted by the server) and checks that
the reply is whole (its subjects' message counts add up to the stream's message count;
the server pages replies above ``SUBJECTS_PAGE``), then reads each key. Keys whose last
message is a delete or purge marker (``asyncrl.jetstream.kv_forget``) are skipped.

Contract: call it when nobody else is writing to the bucket (a service's start, before its
loops run); a concurrent write is retried up to ``ATTEMPTS`` times, then raises
:class:`KvListingError`. Needs only ``$JS.API.STREAM.INFO.*`` and direct/message gets, which
every service user that reads a bucket already has (docker/nats/nats.conf).
"""

from __future__ import annotations

import asyncio
import logging

from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError

log = logging.getLogger(__name__)

SUBJECTS_PAGE = 100_000  # the most subjects nats-server puts in one stream-info reply
ATTEMPTS = 3


class KvListingError(RuntimeError):
    """The bucket could not be listed whole (too many keys for one reply, or writes racing)."""


async def kv_entries(js: JetStreamContext, bucket: str, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
    """``(key, value)`` for every key of ``bucket`` holding a non-empty value, in key order."""
    kv = await js.key_value(bucket)
    prefix = f"$KV.{bucket}."
    for attempt in range(ATTEMPTS):
        info = await asyncio.wait_for(js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>"), timeout_s)
        subjects = info.state.subjects or {}
        if sum(subjects.values()) == info.state.messages:
            break
        if len(subjects) >= SUBJECTS_PAGE:
            raise KvListingError(f"KV bucket {bucket!r} holds more than {SUBJECTS_PAGE} keys: one stream-info "
                                 "reply cannot list them")
        log.info("KV bucket %s changed while it was listed (attempt %d), listing again", bucket, attempt + 1)
    else:
        raise KvListingError(f"KV bucket {bucket!r} kept changing while it was listed ({ATTEMPTS} attempts); "
                             "list it when nothing else writes to it")
    out = []
    for subject in sorted(subjects):
        key = subject[len(prefix):]
        try:
            entry = await asyncio.wait_for(kv.get(key), timeout_s)
        except (KeyDeletedError, KeyNotFoundError):  # forgotten, or its marker expired meanwhile
            continue
        if entry.value:
            out.append((key, bytes(entry.value)))
    return out
