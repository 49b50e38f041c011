"""Rank 0's durable pull consumer on the run's stream: decode, dedup, dead-letter, assemble
whole groups, ack after committed steps, keep held messages alive, purge what checkpoints cover.

Runs on the :class:`~trainer_daemon.io_loop.IoLoop` (every method is a coroutine of that loop;
nothing here is touched from another thread).

- ``start``: the durable consumer ``trainer`` is deleted and recreated at ``cursor + 1``
  (``DeliverPolicy.BY_START_SEQUENCE``), filtered on the trajectories subject, explicit acks,
  ``max_deliver=-1`` (the server never gives up on a message), ``ack_wait`` (``trainer.ack_wait_s``,
  default ``ACK_WAIT_S``).
  Acks are flow control only: correctness comes from the checkpointed cursor (``state.py``).
- Each delivered message: already resolved (``seq`` or id) → ack, skip. Undecodable
  (``WireDecodeError``: garbage, unknown schema version, broken invariants) or not admissible
  for this run's policy (``admission.py``: another run, a token outside the vocabulary, too
  long) → ``term()``,
  copied to the run's dead-letter subject (headers ``Asyncrl-Reason``, ``Asyncrl-Stream-Seq``,
  ``Nats-Msg-Id: dlq-<seq>`` so a replay after a crash does not copy it twice), counted,
  logged; never an exception. A trajectory id already held → ``duplicate``. Otherwise held.
- The rollout's end-of-data message (:mod:`asyncrl.wire.end_of_data`) → acked, resolved as
  ``end``, remembered with its sequence in the checkpointed counters. The marker is *read*
  (``marker_read``) once it was seen *and* every sequence before it was delivered in this
  incarnation or resolved: a trainer restored from a checkpoint taken after the marker but
  before the trajectories ahead of it were trained reads those again first.
- **The end** (``data_ended``): the marker read, and the server agrees (``consumer_info``):
  nothing undelivered (``num_pending`` 0; a message published after the marker, e.g. by an
  external session, is read first) and no message delivered that this instance neither holds
  nor acked (``num_ack_pending`` ≤ held). A mismatch that persists ``END_CHECKS`` reads
  (acks are processed asynchronously) means deliveries went elsewhere: resync (below). From
  the end on every group still waiting for a member is released incomplete; ``take_rest``
  hands over the groups left when they no longer make a whole step (the daemon trains them as
  a last, smaller step, as verl's trainer trains the samples it holds at its rollouter's end
  signal).
- **Gaps**: the cursor rule (``state.py``) needs every delivery of the consumer to reach this
  instance in stream order. Each delivery carries the consumer's sequence (1, 2, ... from the
  consumer's creation; a redelivery takes a new one). A jump means deliveries this instance
  never saw: taken by another client bound to the same durable (a trainer of the same run
  still alive, a consumer instance of a process that died while its pull was outstanding)
  or lost in the client. They would come back only after ``ack_wait`` and out of order, below
  a cursor that had moved past them: skipped as resolved, never trained. So the message
  showing the jump is not processed; the consumer is recreated at ``cursor + 1`` (``resyncs``,
  logged) and everything above the cursor is delivered again, in order (held messages are
  recognised by sequence, resolved ones skipped).
- ``next_batch(k, ...)`` waits up to ``wait_s`` for ``k`` groups (``groups.py``); stale and
  excluded (``exclusion.py``) trajectories travel with their group and are resolved with it
  at commit, so a checkpoint never separates them.
- ``commit`` resolves the step's messages, acks them at once (the rollout service reads the
  consumer's ``num_pending + num_ack_pending`` as its queue depth) and writes the ledger entry.
- ``heartbeat_loop`` sends ``+WPI`` (in progress) for every held message every
  ``HEARTBEAT_S`` (the daemon: a quarter of ``ack_wait``) so a long step or a slow group
  never lets ``ack_wait`` expire.
- ``purge_through(seq)`` removes trajectory messages ``<= seq`` (the oldest kept checkpoint's
  cursor) and all but the newest ``dead_letters_keep`` dead letters.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from asyncrl.wire import (
    END_OF_DATA_HEADER,
    NatsNames,
    Trajectory,
    WireDecodeError,
    decode_trajectory,
    is_end_of_data,
)
from trainer_daemon.algo import StalenessBound, batch_version_metrics
from trainer_daemon.consume.exclusion import excluder
from trainer_daemon.consume.groups import GroupAssembler, Held, PendingGroup
from trainer_daemon.consume.state import ConsumptionState
from trainer_daemon.state.ledger import Ledger

log = logging.getLogger(__name__)

ACK_WAIT_S = 60.0  # redelivery after this without an ack or heartbeat; heartbeats keep held messages alive
HEARTBEAT_S = 15.0  # a quarter of ACK_WAIT_S: two lost heartbeats still leave margin
FETCH_WAIT_S = 1.0  # one pull request's expiry; next_batch loops until its own deadline
FETCH_BATCH_MAX = 256  # messages per pull request
ACK_PENDING_MIN = 1024  # the server stops delivering silently at max_ack_pending (RELIABILITY §1)
GROUP_PATIENCE_MIN = 256  # messages after a group's first member before it is released incomplete
# A group's members finish at different times; meanwhile every other trajectory in flight may
# finish too. Patience is this many times the trajectories the rollout keeps in flight, so only
# a member that is really lost (or poison) releases a group early.
GROUP_PATIENCE_PER_IN_FLIGHT = 4
DLQ_REASON_MAX = 512  # characters of the decode error copied into the dead letter's header
NATS_OP_TIMEOUT_S = 10.0  # one JetStream API request (consumer create, purge, info)
END_CHECKS = 3  # consecutive end-of-data checks finding deliveries neither held nor acked before a resync
END_HORIZON = 2**62  # "the stream has been read to its end": every group's release point is behind it


def consumer_limits(required_trajectories: int, in_flight: int = 0) -> tuple[int, int]:
    """``(group_patience, max_ack_pending)`` for a step of ``required_trajectories`` while the
    rollout keeps ``in_flight`` trajectories generating (``DerivedNumbers.max_concurrent_samples``)."""
    patience = max(GROUP_PATIENCE_MIN, 4 * required_trajectories, GROUP_PATIENCE_PER_IN_FLIGHT * in_flight)
    return patience, max(ACK_PENDING_MIN, 2 * patience + 2 * required_trajectories)


class TrajectorySource:
    """See the module docstring."""

    def __init__(self, names: NatsNames, state: ConsumptionState, ledger: Ledger, required_trajectories: int,
                 ack_wait_s: float = ACK_WAIT_S, in_flight: int = 0, dead_letters_keep: int = 10_000, *,
                 effective: Callable[[int], int] = lambda v: v, exclude: Callable | None = None,
                 admit: Callable[[Trajectory], str] = lambda traj: "") -> None:
        self.names = names
        self.dead_letters_keep = dead_letters_keep
        self.ack_wait_s = ack_wait_s
        self.state = state
        self.ledger = ledger
        patience, self.max_ack_pending = consumer_limits(required_trajectories, in_flight)
        self.assembler = GroupAssembler(patience)
        self._js: JetStreamContext | None = None
        self._sub = None
        self._msgs: dict[int, object] = {}  # seq -> latest Msg of every held message
        self._held_ids: set[str] = set()
        self._pending: list[PendingGroup] = []
        self.effective = effective
        """Maps a weight version to training steps (``trainer_daemon.state.lineage.Lineage.effective``)."""
        self.exclude = exclude or excluder("train")
        """Names why a trajectory must not be trained (``exclusion.py``), from the run's config."""
        self.admit = admit
        """Names why a decoded trajectory cannot be trained by this run's policy at all
        (``admission.py``: run id, vocabulary, length): it is dead-lettered as poison."""
        self.redelivered_skipped = 0
        """Redeliveries of messages already resolved (acked again, skipped)."""
        self.redelivered_held = 0
        """Redeliveries of messages still held (``ack_wait`` passed without a heartbeat: a frozen trainer)."""
        self.resyncs = 0
        """Consumers recreated because deliveries did not reach this instance (module docstring, "Gaps")."""
        self._next_delivery = 1  # the consumer sequence the next delivery must carry
        self._end_checks = 0
        self._end_confirmed = False

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, js: JetStreamContext) -> None:
        self._js = js
        await self._create_consumer()

    async def _create_consumer(self) -> None:
        """(Re)create the durable consumer at ``cursor + 1`` and bind a fresh pull subscription:
        from here every delivery is this instance's, in stream order, consumer sequence 1, 2, ..."""
        js, stream, durable = self._js, self.names.stream, self.names.trainer_consumer
        try:
            await js.delete_consumer(stream, durable)
        except NotFoundError:
            pass
        config = ConsumerConfig(
            durable_name=durable, filter_subject=self.names.trajectories,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.state.cursor + 1,
            ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait_s, max_deliver=-1,
            max_ack_pending=self.max_ack_pending,
        )
        await js.add_consumer(stream, config, timeout=NATS_OP_TIMEOUT_S)
        self._sub = await js.pull_subscribe_bind(durable=durable, stream=stream)
        self._next_delivery = 1
        self._end_checks = 0
        log.info("consumer %s on %s starts at sequence %d", durable, stream, self.state.cursor + 1)

    async def _resync(self, why: str) -> None:
        """A delivery of this consumer never reached this instance (module docstring, "Gaps"):
        read everything above the cursor again, in order, from a recreated consumer."""
        self.resyncs += 1
        log.warning("%s: recreating consumer %s at sequence %d to read what it sent elsewhere again "
                    "(is another trainer of run %s consuming?)", why, self.names.trainer_consumer,
                    self.state.cursor + 1, self.names.run_id)
        await self.close()
        await self._create_consumer()

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - connection may already be gone
                log.debug("unsubscribe failed: %s", exc)
            self._sub = None

    # -- intake ----------------------------------------------------------------------------
    async def _fetch(self, wait_s: float) -> list:
        room = min(FETCH_BATCH_MAX, self.max_ack_pending - len(self._msgs))
        if room <= 0:
            await asyncio.sleep(wait_s)
            return []
        try:
            return await self._sub.fetch(batch=room, timeout=max(0.05, wait_s))
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return []
        except nats.errors.Error as exc:  # disconnected: the client reconnects on its own
            log.warning("fetch failed (%s); retrying", exc)
            await asyncio.sleep(min(wait_s, FETCH_WAIT_S))
            return []

    async def _poison(self, msg, seq: int, reason: str) -> None:
        log.warning("poison message at stream sequence %d: %s", seq, reason)
        try:
            await msg.term()
        except Exception as exc:  # noqa: BLE001 - flow control only; the cursor resolves it
            log.warning("term of sequence %d failed: %s", seq, exc)
        headers = {"Nats-Msg-Id": f"dlq-{seq}", "Asyncrl-Reason": reason[:DLQ_REASON_MAX].replace("\n", " "),
                   "Asyncrl-Stream-Seq": str(seq)}
        try:
            ack = await self._js.publish(self.names.dead_letters, msg.data, headers=headers, timeout=NATS_OP_TIMEOUT_S)
            self.ledger.note("dlq", int(ack.seq))
        except Exception as exc:  # noqa: BLE001 - counted and logged either way
            log.error("copying sequence %d to %s failed: %s", seq, self.names.dead_letters, exc)
        self.state.resolve([(seq, "poison", "")])
        self.state.count("poison")
        self.ledger.note("poison", seq)

    async def _process(self, msgs: list) -> None:
        for msg in msgs:
            seq, delivery = int(msg.metadata.sequence.stream), int(msg.metadata.sequence.consumer)
            if delivery < self._next_delivery:  # a delivery already handled (cannot happen with one subscription)
                continue
            if delivery > self._next_delivery:  # deliveries missed: they went to another client, or were lost
                self.state.resolve([])
                await self._resync(f"consumer deliveries {self._next_delivery}..{delivery - 1} never reached this trainer")
                return
            self._next_delivery += 1
            self.state.delivered(seq)
            if self.state.is_resolved(seq):
                self.redelivered_skipped += 1
                await _quiet_ack(msg)
                continue
            if seq in self.state.held:  # ack_wait redelivery: keep the newest reply subject
                self._msgs[seq] = msg
                self.redelivered_held += 1
                continue
            if is_end_of_data(msg.headers):  # the last word: nothing follows it in the stream
                await _quiet_ack(msg)
                self.state.resolve([(seq, "end", "")])
                if not self.state.counters["end_of_data"]:
                    log.info("the rollout's end of data at stream sequence %d (%s samples started)", seq,
                             msg.headers.get(END_OF_DATA_HEADER))
                self.state.counters["end_of_data"] = 1
                self.state.counters["end_of_data_seq"] = self.state.counters.get("end_of_data_seq") or seq
                self.ledger.note("end", seq)
                continue
            try:
                traj = decode_trajectory(msg.data)
            except WireDecodeError as exc:
                await self._poison(msg, seq, str(exc))
                continue
            refused = self.admit(traj)
            if refused:
                await self._poison(msg, seq, f"trajectory {traj.id}: {refused}")
                continue
            if self.state.knows_id(traj.id) or traj.id in self._held_ids:
                log.warning("duplicate trajectory id %s at sequence %d: skipped", traj.id, seq)
                await _quiet_ack(msg)
                self.state.resolve([(seq, "duplicate", traj.id)])
                self.state.count("duplicate")
                self.ledger.note("duplicate", traj.id, seq)
                continue
            self.state.hold(seq)
            self._msgs[seq] = msg
            self._held_ids.add(traj.id)
            self.assembler.add(Held(seq, traj, bytes(msg.data)))
        self.state.resolve([])  # advance over skipped sequences

    @property
    def marker_read(self) -> bool:
        """The rollout's end-of-data message was read (now or before a restart) and every
        message ahead of it in the stream was delivered to this instance since, or resolved
        before the checkpoint (deliveries reach this instance in stream order: see "Gaps")."""
        c = self.state.counters
        return bool(c["end_of_data"]) and self.state.max_delivered >= c.get("end_of_data_seq", 0)

    @property
    def data_ended(self) -> bool:
        """Nothing more comes: :attr:`marker_read`, and the server confirmed it (module
        docstring, "The end"): no message undelivered, none delivered that this instance
        neither holds nor acked."""
        return self._end_confirmed

    async def _confirm_end(self) -> None:
        if self._end_confirmed or not self.marker_read:
            return
        try:
            info = await self._js.consumer_info(self.names.stream, self.names.trainer_consumer, timeout=NATS_OP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - asked again at the next read
            log.warning("could not confirm the end of data with the server (%s); asking again", exc)
            return
        elsewhere = int(info.num_ack_pending) - len(self._msgs)
        if int(info.num_pending) == 0 and elsewhere <= 0:
            self._end_confirmed = True
            return
        if int(info.num_pending) > 0:  # published after the marker (an external session): read it first
            return
        self._end_checks += 1  # acks are processed asynchronously: a mismatch must persist
        if self._end_checks >= END_CHECKS:
            await self._resync(f"at the end of data {elsewhere} message(s) were delivered but neither held nor acked here")

    async def _take(self, k: int, version: int, bound: StalenessBound | None) -> None:
        need = k - len(self._pending)
        # after the end of data no member can still arrive: every group waiting for one is released now
        horizon = END_HORIZON if self.data_ended else self.state.max_delivered
        if need <= 0 or not self.assembler.num_ready(horizon):
            return
        taken = self.assembler.take(need, horizon, version, bound, self.effective, self.exclude)
        self._pending.extend(taken.groups)
        # every member too stale: nothing to train; resolved (dropped) now and acked, as a
        # committed step's messages are (issue 65: unacked, they read as delivered elsewhere at
        # the end of data, and the server redelivered them after ack_wait)
        resolved = [m for group in taken.empty for m in self._resolve_group(group)]
        await asyncio.gather(*(_quiet_ack(m) for m in resolved))

    async def next_batch(self, k: int, version: int, bound: StalenessBound | None, wait_s: float) -> list[PendingGroup] | None:
        """``k`` groups to train, or None when they did not arrive within ``wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            await self._take(k, version, bound)
            if len(self._pending) >= k:
                batch, self._pending = self._pending[:k], self._pending[k:]
                return batch
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            await self._process(await self._fetch(min(remaining, FETCH_WAIT_S)))
            await self._confirm_end()

    async def take_rest(self, version: int, bound: StalenessBound | None) -> list[PendingGroup]:
        """After the end of data: every group still held (all released: no member can still
        come), to train as a last step smaller than ``k``; [] when nothing is left."""
        if not self.data_ended:
            raise RuntimeError("take_rest before the end of the data: more groups may still come")
        await self._take(2**31, version, bound)
        rest, self._pending = self._pending, []
        return rest

    # -- commit ----------------------------------------------------------------------------
    def _resolve_group(self, group: PendingGroup) -> list:
        unused = group.unused
        items = [(h.seq, "trained", h.traj.id) for h in group.kept] + [(h.seq, "dropped", h.traj.id) for h in unused]
        self.state.resolve(items)
        self.state.count("dropped", len(group.dropped))
        self.state.count("dropped_tokens", sum(sum(h.traj.loss_mask) for h in group.dropped))
        self.state.count("incomplete_groups", int(group.incomplete))
        for h, reason in group.excluded:
            self.state.count("excluded")
            self.state.count(f"excluded/{reason}")
            log.info("trajectory %s not trained: %s", h.traj.id, reason)
        for h in unused:
            self.ledger.note("dropped", h.traj.id, h.seq)
        msgs = []
        for h in group.kept + unused:
            self._held_ids.discard(h.traj.id)
            msg = self._msgs.pop(h.seq, None)
            if msg is not None:
                msgs.append(msg)
        return msgs

    async def commit(self, groups: list[PendingGroup], step: int, version: int) -> dict[str, float]:
        """Resolve and ack a committed step's messages; returns verl's fully_async metrics."""
        msgs = []
        for g in groups:
            msgs.extend(self._resolve_group(g))
        trained = [h for g in groups for h in g.kept]
        self.state.count("trained", len(trained))
        self.state.count("truncated_sampling_trained", sum(h.traj.truncation_uncorrected for h in trained))
        self.ledger.commit(step, version, [h.traj.id for h in trained], [h.seq for h in trained],
                           [(h.traj.version_start, h.traj.version_end) for h in trained])
        c = self.state.counters
        metrics = batch_version_metrics([h.traj for h in trained], version, prev_stale_samples=c["stale_samples"],
                                        prev_stale_trajectories=c["stale_trajectories"], effective=self.effective)
        c["stale_samples"] = int(metrics["fully_async/count/stale_samples_processed"])
        c["stale_trajectories"] = int(metrics["fully_async/count/stale_trajectory_processed"])
        await asyncio.gather(*(_quiet_ack(m) for m in msgs))
        return metrics

    # -- upkeep ----------------------------------------------------------------------------
    async def heartbeat_loop(self, interval_s: float = HEARTBEAT_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            for msg in list(self._msgs.values()):
                try:
                    await msg.in_progress()
                except Exception as exc:  # noqa: BLE001 - redelivery is harmless (dedup by seq)
                    log.debug("in_progress failed: %s", exc)

    async def purge_through(self, seq: int) -> None:
        if seq < 1 or self._js is None:
            return
        try:
            await asyncio.wait_for(self._js.purge_stream(self.names.stream, seq=seq + 1, subject=self.names.trajectories),
                                   NATS_OP_TIMEOUT_S)
            await asyncio.wait_for(self._js.purge_stream(self.names.stream, subject=self.names.dead_letters,
                                                         keep=self.dead_letters_keep), NATS_OP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - retried after the next checkpoint
            log.warning("purging %s through sequence %d failed: %s", self.names.stream, seq, exc)

    async def lag(self) -> dict[str, float]:
        """Consumer lag (messages not delivered yet) and acks pending, as metrics."""
        try:
            info = await self._js.consumer_info(self.names.stream, self.names.trainer_consumer, timeout=NATS_OP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - metrics are best effort
            log.debug("consumer_info failed: %s", exc)
            return {}
        return {"trainer/consumer_lag": float(info.num_pending), "trainer/consumer_ack_pending": float(info.num_ack_pending),
                "trainer/consumer_max_ack_pending": float(self.max_ack_pending)}


async def _quiet_ack(msg) -> None:
    try:
        await msg.ack()
    except Exception as exc:  # noqa: BLE001 - acks are flow control; a lost one means a redelivery we skip
        log.debug("ack failed: %s", exc)
