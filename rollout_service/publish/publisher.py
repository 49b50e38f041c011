"""Publishing the outbox to JetStream, exactly once.

``TrajectoryPublisher.run`` drains the outbox's ready queue oldest first, in windows of up
to ``PUBLISH_WINDOW`` publishes in flight at once (their PubAcks handled in send order; an
entry whose first attempt fails continues alone, with the retries below): each trajectory is
published to the run's trajectory subject with ``Nats-Msg-Id`` = its id and removed from
the outbox only after a PubAck (``duplicate: true`` counts as stored — an earlier attempt
landed). Order in the stream follows the outbox except around a retry. Transient failures (no connection, timeouts, no responders while NATS restarts,
a full stream) are retried with capped exponential backoff, forever: the outbox bound,
not the publisher, is what eventually stops admission. A trajectory the server refuses
for good (too large) is first retried without its debug ``messages``, then moved to the
outbox's ``rejected/`` directory and counted — never silently dropped.

Every PubAck is also written to the *published record* (``<run dir>/rollout/published.jsonl``,
``{"id", "seq", "duplicate", "time"}`` per line, before the entry leaves the outbox), which
outlives restarts of the service: what it published, with the stream sequences, for an audit
beside the trainer's ledger. Bounded by ``rollout.published_record_max_bytes`` (one rotated
file kept, ``asyncrl.jsonl_log``). A trajectory re-published after a crash between its PubAck
and the outbox removal appears again with ``duplicate: true`` and the same sequence.

A NATS host crash can lose messages it had acknowledged (RELIABILITY F3: unflushed pages); the
stream then restarts shorter and hands out the lost sequences again. The publisher notices when
a new (non-duplicate) PubAck's sequence is not above the highest it has seen (from this process,
or the published record's last line after a restart) and puts every acknowledged entry the
outbox still keeps (``rollout.outbox_keep_acked_s``, default longer than NATS's 2-minute sync
interval) back in the queue: the lost ones are stored again, the others answer as duplicates
(``stats.requeued_after_loss``). Older losses are only recorded (``asyncrl audit``).

The dedup window (``nats.duplicate_window_s``) must exceed how long an entry can sit in the
outbox between a lost PubAck and its retry; with the default 30 min and the 5 s backoff cap
that holds unless NATS is down for longer than the window (then a duplicate is possible
only for the one message whose ack was lost at the moment of the outage).

Latency (``PublishLatency``, Prometheus histograms): ``request`` is one publish request to its
PubAck (the round trip to JetStream, retries excluded); ``delay`` is from the trajectory's
outbox write (the file's mtime) to its PubAck: the time a finished trajectory waits before the
trainer can see it, queueing and retries included.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from nats.errors import MaxPayloadError
from nats.js.errors import APIError
from prometheus_client import Histogram

from asyncrl.jsonl_log import BoundedJsonl
from asyncrl.wire import decode_trajectory, encode_trajectory
from rollout_service.publish.outbox import Outbox, OutboxEntry

log = logging.getLogger(__name__)

PUBLISH_WINDOW = 64  # first attempts in flight at once (bench/control_plane.py: one at a time capped the service)
PUBLISH_TIMEOUT_S = 5.0  # one publish request; a healthy server answers in ~1 ms
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 5.0  # keeps a recovered NATS reached within seconds, far below the dedup window
IDLE_WAIT_S = 1.0
PRUNE_EVERY_S = 5.0  # how often acknowledged entries past the keep window are dropped  # re-scan the outbox at least this often even without a notification
JS_ERR_MESSAGE_TOO_LARGE = 10054  # JSStreamMessageExceedsMaximumErr


@dataclass
class PublisherStats:
    published: int = 0
    duplicates: int = 0
    retries: int = 0
    rejected: int = 0
    stripped_messages: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    last_publish_at: float | None = None
    requeued_after_loss: int = 0
    """Acknowledged entries put back in the queue because the stream went back (F3)."""


LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                     0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)


class PublishLatency:
    """The publisher's two latency histograms (not registered anywhere: the service's collector
    yields them, so each service instance has its own)."""

    def __init__(self) -> None:
        self.request = Histogram("asyncrl_rollout_publish_request_seconds",
                                 "One JetStream publish request to its PubAck", buckets=LATENCY_BUCKETS_S, registry=None)
        self.delay = Histogram("asyncrl_rollout_publish_delay_seconds",
                               "Outbox write of a finished trajectory to its PubAck (queueing and retries included)",
                               buckets=LATENCY_BUCKETS_S, registry=None)

    def collect(self):
        yield from self.request.collect()
        yield from self.delay.collect()


PublishFn = Callable[[str, bytes, dict[str, str]], Awaitable[object]]


class TrajectoryPublisher:
    """Drains an :class:`Outbox` into JetStream (see the module docstring).

    ``publish`` is ``js.publish``-compatible: ``(subject, payload, headers) -> PubAck``.
    Passing the function rather than a connection lets the service swap connections.
    """

    def __init__(self, outbox: Outbox, subject: str, publish: PublishFn, record: BoundedJsonl | None = None) -> None:
        self.outbox = outbox
        self.record = record
        self.subject = subject
        self._publish = publish
        self._wakeup = asyncio.Event()
        self.stats = PublisherStats()
        self.latency = PublishLatency()
        last = record.last() if record is not None else None
        self.highest_seq = int(last.get("seq", 0)) if last else 0
        """The highest stream sequence acknowledged so far (a new one at or below it: the server lost messages)."""
        self._pruned_at = 0.0
        self._windows_in_flight = 0  # a window's acknowledged files leave ready/ before its stats and count are done

    def notify(self) -> None:
        """New entries are ready: wake the loop now."""
        self._wakeup.set()

    @property
    def pending(self) -> int:
        return len(self.outbox.ready_entries())

    async def run(self, stop: asyncio.Event) -> None:
        """Publish until ``stop`` is set (entries left over stay in the outbox)."""
        while not stop.is_set():
            entries = self.outbox.ready_entries()
            if not entries:
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), IDLE_WAIT_S)
                except TimeoutError:
                    pass
                continue
            for start in range(0, len(entries), PUBLISH_WINDOW):
                if stop.is_set():
                    return
                self._windows_in_flight += 1
                try:
                    await self._publish_window(entries[start:start + PUBLISH_WINDOW], stop)
                finally:
                    self._windows_in_flight -= 1
                await self._prune_if_due()

    async def _prune_if_due(self) -> None:
        """Drop acknowledged entries past the keep window, at most every ``PRUNE_EVERY_S``, in a
        worker thread: the scan stats every kept file (tens of thousands at a few hundred
        trajectories/s), which on the loop stalled it for ~0.3 s each time."""
        now = time.monotonic()
        if self.outbox.keep_acked_s > 0 and now - self._pruned_at > PRUNE_EVERY_S:
            self._pruned_at = now
            await asyncio.to_thread(self.outbox.prune_acked)

    async def _publish_window(self, entries: list[OutboxEntry], stop: asyncio.Event) -> None:
        """Up to ``PUBLISH_WINDOW`` first attempts in flight at once (one round trip for all
        instead of one each); their PubAcks are handled in send order (the stream-went-back
        check compares sequences in that order); an entry whose first attempt failed goes
        through the one-at-a-time path with its retries, stripping and rejection."""
        loaded = await asyncio.to_thread(self._load, entries)
        results = await asyncio.gather(*(self._attempt(entry, payload) for entry, payload, _ in loaded), return_exceptions=True)
        acked: list[tuple[OutboxEntry, object, float | None]] = []
        retry: list[OutboxEntry] = []
        for (entry, _, written_at), result in zip(loaded, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                self._note_retry(result)
                retry.append(entry)
            else:
                acked.append((entry, result, written_at))
        await self._handle_acks(acked)
        for entry in retry:
            if stop.is_set():
                return
            await self._publish_until_done(entry, stop)

    def _load(self, entries: list[OutboxEntry]) -> list[tuple[OutboxEntry, bytes, float | None]]:
        out = []
        for entry in entries:
            try:
                out.append((entry, self.outbox.read(entry), self.outbox.written_at(entry)))
            except FileNotFoundError:  # acknowledged meanwhile (a requeue raced it): nothing to send
                continue
        return out

    async def _attempt(self, entry: OutboxEntry, payload: bytes) -> object:
        sent = time.monotonic()
        ack = await asyncio.wait_for(self._publish(self.subject, payload, {"Nats-Msg-Id": entry.trajectory_id}), PUBLISH_TIMEOUT_S)
        self.latency.request.observe(time.monotonic() - sent)
        return ack

    async def _handle_acks(self, acked: list[tuple[OutboxEntry, object, float | None]]) -> None:
        """Count, record (one append for the window) and remove from the outbox, in send order."""
        if not acked:
            return
        now = time.time()
        records, removals = [], []
        for entry, ack, written_at in acked:
            seq = int(getattr(ack, "seq", 0) or 0)
            duplicate = bool(getattr(ack, "duplicate", False))
            if duplicate:
                self.stats.duplicates += 1
            else:
                self.stats.published += 1
            if written_at is not None:
                self.latency.delay.observe(max(0.0, now - written_at))
            records.append({"id": entry.trajectory_id, "seq": seq, "duplicate": duplicate, "time": now})
            removals.append((entry, seq or None, duplicate))
        self.stats.last_publish_at = now
        if self.record is not None:
            self.record.append_many(records)
        await self.outbox.ack_many([(entry, seq) for entry, seq, _ in removals])
        for _, seq, duplicate in removals:
            self._after_ack(seq or 0, duplicate)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until the ready queue is empty and no window is being acknowledged (True: the
        stats and the outbox's count include every entry sent), or the timeout passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self._windows_in_flight or self.outbox.ready_entries():
            if time.monotonic() > deadline:
                return False
            self.notify()
            await asyncio.sleep(0.05)
        return True

    async def _publish_until_done(self, entry: OutboxEntry, stop: asyncio.Event) -> None:
        payload = self.outbox.read(entry)
        written_at = self.outbox.written_at(entry)
        backoff = BACKOFF_START_S
        while not stop.is_set():
            sent = time.monotonic()
            try:
                ack = await asyncio.wait_for(
                    self._publish(self.subject, payload, {"Nats-Msg-Id": entry.trajectory_id}), PUBLISH_TIMEOUT_S
                )
            except (MaxPayloadError, APIError) as exc:
                if isinstance(exc, APIError) and exc.err_code != JS_ERR_MESSAGE_TOO_LARGE:
                    self._note_retry(exc)  # e.g. stream full (discard=new): wait for the trainer to free space
                else:
                    stripped = self._strip_debug_messages(payload)
                    if stripped is not None:
                        payload = stripped
                        self.stats.stripped_messages += 1
                        continue
                    self.outbox.reject(entry, f"refused by the server: {exc}")
                    self.stats.rejected += 1
                    log.error("trajectory %s rejected for good: %s", entry.trajectory_id, exc)
                    return
            except Exception as exc:  # noqa: BLE001 - every other failure is transient here
                self._note_retry(exc)
            else:
                self.latency.request.observe(time.monotonic() - sent)
                await self._handle_acks([(entry, ack, written_at)])
                return
            await asyncio.sleep(backoff)
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    def _after_ack(self, seq: int, duplicate: bool) -> None:
        if not duplicate and 0 < seq <= self.highest_seq:  # the stream went back: it lost acknowledged messages
            moved = self.outbox.requeue_acked()
            self.stats.requeued_after_loss += moved
            log.error("the stream went back (sequence %d after %d): NATS lost acknowledged messages (a host crash?); "
                      "%d kept entries queued again", seq, self.highest_seq, moved)
            self.notify()
            self.highest_seq = seq
        else:  # a duplicate answers with its original (lower) sequence: it never lowers the mark
            self.highest_seq = max(self.highest_seq, seq)

    def _note_retry(self, exc: Exception) -> None:
        self.stats.retries += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        self.stats.last_error_at = time.time()
        log.warning("publish failed, will retry: %s", self.stats.last_error)

    @staticmethod
    def _strip_debug_messages(payload: bytes) -> bytes | None:
        """The same trajectory without its debug ``messages`` (None if it had none)."""
        traj = decode_trajectory(payload)
        if traj.messages is None:
            return None
        return encode_trajectory(msgspec.structs.replace(traj, messages=None))
