"""The engine side of one weight update: the one implementation of the sequence, used by
the sync agent (``sync_agent/coordinator.py``) and the trainer's direct publisher
(``trainer_daemon/sync/direct.py``).

    pause(mode)     /pause_generation on every member
    begin()         /begin_weight_update (SGLang 0.5.21+ refuses updates outside a session;
                    404 = older server, none needed; 400 "already open" = a session left by
                    a sync that died: end it and begin again)
    join(...)       /init_weights_update_group on every member at its rank offset (from
                    read_layouts), while the sender hosts the group
    load(bucket)    /update_weights_from_distributed on every member while the sender
                    broadcasts the bucket's bytes; the first error answer stops the wait
    end()           /end_weight_update (also after a failure)
    check_weights() /weights_checker: members whose weights disagree with the others' are
                    ``mixed`` (asyncrl.sync_control.weights_check)
    flush()         /flush_cache?timeout=: the engine flushes once its aborted requests drained
    resume()        /continue_generation on every member paused here (callers: in a finally)

Every call is bounded. :meth:`EngineUpdate.load` watches each engine's HTTP answer while the
broadcast runs: an error answer (SGLang answers at once when it refuses a bucket, e.g. without
a session, and then never joins the broadcast) calls ``on_failure`` and sets the sender's
cancel event at once, instead of leaving the sender in the collective until its timeout. It
also asks every member still loading for ``/model_info`` each ``LIVENESS_INTERVAL_S``: a
member that does not answer within ``LIVENESS_TIMEOUT_S`` is hung (a live SGLang answers it
from its tokenizer manager while its scheduler loads), and the bucket fails then, not at the
broadcast's timeout (issue 33: the others were paused for the whole of it).

Outcome per member after a failure (:meth:`EngineUpdate.outcome`): ``loaded`` (confirmed
every bucket and closed its session), ``unchanged`` (no bucket call was sent to it), else
``mixed``: SGLang applies each bucket as it arrives and has no consistency flag, so an engine
that did not confirm every bucket may serve two versions and must be quarantined and reloaded.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from asyncrl.engine_client import EngineClient, EngineError, EngineHTTPError, WeightsCheck
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.sync_control.layout import EngineLayout, assign_ranks
from asyncrl.sync_control.weights_check import disagreeing
from asyncrl.wire.sync import DEFAULT_GROUP_NAME, BucketSpec


class HostedGroup(Protocol):
    """A weight group hosted in this process (the direct publisher's
    ``asyncrl.weight_sync.group.WeightGroup``): the control side only hands it back, or
    destroys it when the engines failed to join (it never names the torch package)."""

    def destroy(self) -> None: ...


G = TypeVar("G", bound=HostedGroup)

log = logging.getLogger(__name__)

REPLY_SLACK_S = 10.0  # an engine answers just after its side of the broadcast and the load
LIVENESS_TIMEOUT_S = 3.0  # /model_info answers at once from a live engine (ms, also under load); a hung one is not waited for longer
LIVENESS_INTERVAL_S = 0.5  # how often members still loading a bucket are asked
REPLY_GRACE_S = 3.0  # after one engine failed a bucket, how long the others may still confirm it
FLUSH_RETRIES = 30  # flush_cache answers 400 while aborted requests drain
FLUSH_INTERVAL_S = 0.2

class MembersHung(WeightSyncError):
    """Members that stopped answering ``/model_info`` while loading (``ids``)."""

    def __init__(self, ids: set[str], message: str) -> None:
        super().__init__(message)
        self.ids = ids


LIVENESS = "liveness"
"""``waiting``'s value for the liveness watch of :meth:`EngineUpdate.load` (not a member, not the sender)."""

Sender = Callable[[threading.Event], Awaitable[None]]
"""The local sender's broadcast of one bucket; must stop (raise) soon after the event is set."""


@dataclass
class Member:
    """One engine taking part in the update, and what it confirmed."""

    id: str
    client: EngineClient
    rank_offset: int = 1
    ranks: int = 1
    """Ranks it takes in the group (its TP size, from read_layouts)."""
    release: str | None = None
    """Its SGLang release (``/server_info``'s ``version``), once read (read_layouts, check_weights)."""
    weights_kind: str | None = None
    """What its weights checksum is comparable with (``EngineLayout.weights_kind``), once read."""
    sent: int = 0
    confirmed: int = 0
    paused: bool = False
    session: bool = False
    error: str | None = None
    stuck: bool = False
    """Its last bucket call was given up on: it may sit in a collective until its own timeout
    (SGLang: the process group's, minutes), holding its pause lock, so nothing more is asked of it."""


def _missing_ranks(message: str) -> set[int]:
    """Ranks a timed-out rendezvous was still waiting for, from torch's store error
    ("wait timeout after 3000ms, keys: /<group>/<group>//cpu//0/2"); empty if not found."""
    keys = message.partition("keys:")[2]
    return {int(k) for k in re.findall(r"/(\d+)(?=,|\s|$)", keys)} - {0}


def _errors(results: dict[str, BaseException | None]) -> str:
    return "; ".join(f"{eid}: {exc}" for eid, exc in results.items() if exc is not None)


class EngineUpdate:
    """One update of ``members`` (see the module docstring). Not reusable across syncs."""

    def __init__(self, members: Sequence[Member], *, control_timeout_s: float, total_buckets: int = 0,
                 group_name: str = DEFAULT_GROUP_NAME, reply_grace_s: float = REPLY_GRACE_S) -> None:
        if not members:
            raise ValueError("an update needs at least one engine")
        self.members = list(members)
        self.control_timeout_s = control_timeout_s
        self.total_buckets = total_buckets
        """Buckets of the whole update: a member is ``loaded`` only after confirming all of them."""
        self.group_name = group_name
        self.reply_grace_s = reply_grace_s
        self.buckets = 0

    async def each(self, call: Callable[[Member], Awaitable[Any]], timeout_s: float,
                    members: Sequence[Member] | None = None) -> dict[str, BaseException | None]:
        """``call(m)`` on every member concurrently, each bounded; the error of each (or None)."""
        members = self.members if members is None else members

        async def one(m: Member) -> BaseException | None:
            try:
                await asyncio.wait_for(call(m), timeout_s)
                return None
            except TimeoutError:
                return WeightSyncError(f"no answer within {timeout_s:g} s")
            except Exception as exc:  # noqa: BLE001 - reported per engine
                return exc

        results = await asyncio.gather(*(one(m) for m in members))
        return {m.id: r for m, r in zip(members, results)}

    # -- before the buckets ----------------------------------------------------------------
    async def pause(self, mode: str = "abort") -> None:
        async def one(m: Member) -> None:
            await m.client.pause(mode, timeout_s=self.control_timeout_s)
            m.paused = True

        failed = _errors(await self.each(one, self.control_timeout_s))
        if failed:
            raise WeightSyncError(f"pause_generation failed: {failed}")

    async def begin(self) -> None:
        async def one(m: Member) -> None:
            c, t = m.client, self.control_timeout_s
            try:
                m.session = await c.begin_weight_update(timeout_s=t)
            except EngineHTTPError as exc:
                if exc.status != 400:
                    raise
                log.warning("engine %s has a weight-update session open (%s): closing it first", m.id, exc.message)
                await c.end_weight_update(timeout_s=t)
                m.session = await c.begin_weight_update(timeout_s=t)

        failed = _errors(await self.each(one, 3 * self.control_timeout_s))
        if failed:
            raise WeightSyncError(f"begin_weight_update failed: {failed}")

    async def read_layouts(self) -> tuple[list[EngineLayout], int]:
        """Each member's layout from ``/server_info``; sets rank offsets; returns the layouts
        and the group's world size. Raises LayoutError for a layout SGLang cannot update."""
        infos = await asyncio.gather(*(m.client.server_info(timeout_s=self.control_timeout_s) for m in self.members))
        layouts = [EngineLayout.from_server_info(m.id, info) for m, info in zip(self.members, infos)]
        offsets, world = assign_ranks(layouts)
        for m, offset, layout in zip(self.members, offsets, layouts):
            m.rank_offset, m.ranks, m.release, m.weights_kind = offset, layout.ranks, layout.version, layout.weights_kind
        return layouts, world

    async def join(self, master_address: str, master_port: int, world_size: int, *, backend: str, timeout_s: float,
                   host: Callable[[], Awaitable[G]] | None = None) -> G | None:
        """Every member joins the group at its rank offset; ``host`` (the sender in this
        process) runs concurrently. Any failure destroys a hosted group and raises."""
        await self.leave_group()  # a stale group of that name (best effort)
        joins = asyncio.ensure_future(self.each(lambda m: m.client.init_weights_update_group(
            master_address, master_port, m.rank_offset, world_size, self.group_name, backend,
            timeout_s=timeout_s + REPLY_SLACK_S), timeout_s + REPLY_SLACK_S))
        try:
            group = await host() if host is not None else None
        except WeightSyncError as exc:
            missing = self._members_at(_missing_ranks(str(exc)))
            failed = _errors(await joins)
            raise WeightSyncError(f"group join failed: {'never joined: ' + ', '.join(missing) + '; ' if missing else ''}"
                                  f"{failed or 'every engine answered'}; hosting as rank 0: {exc}") from exc
        failed = _errors(await joins)
        if failed:
            if group is not None:
                await asyncio.to_thread(group.destroy)
            raise WeightSyncError(f"group join failed: {failed}")
        return group

    def _members_at(self, ranks: set[int]) -> list[str]:
        return [m.id for m in self.members if any(m.rank_offset <= r < m.rank_offset + max(1, m.ranks) for r in ranks)]

    # -- the buckets -------------------------------------------------------------------------
    async def load(self, bucket: BucketSpec, *, weight_version: int | None, timeout_s: float, send: Sender | None = None,
                   on_failure: Callable[[str], None] | None = None) -> None:
        """One bucket to every member (HTTP calls first, then the broadcast, then the answers)."""
        self.buckets += 1
        index = self.buckets - 1
        cancel = threading.Event()
        waiting: dict[asyncio.Future, Member | None] = {}
        for m in self.members:
            m.sent += 1
            waiting[asyncio.ensure_future(m.client.update_weights_from_distributed(
                bucket.names, bucket.dtypes, bucket.shapes, group_name=self.group_name, weight_version=weight_version,
                load_format="flattened_bucket", flush_cache=False, timeout_s=timeout_s + REPLY_SLACK_S))] = m
        await asyncio.sleep(0)  # let the requests leave before the sender's thread takes a core
        if send is not None:
            waiting[asyncio.ensure_future(send(cancel))] = None
        limit = timeout_s + REPLY_SLACK_S
        watcher = asyncio.ensure_future(self._liveness(waiting))
        waiting[watcher] = LIVENESS
        finished: list[asyncio.Future] = []
        try:
            finished = await self._wait(waiting, limit, stop_on_error=True, optional=watcher)
        finally:
            if watcher not in finished:
                watcher.cancel()
                waiting.pop(watcher, None)
                await asyncio.gather(watcher, return_exceptions=True)
        failures = self._settle(waiting, finished)
        if not failures and waiting:
            failures = [f"no answer within {limit:g} s from "
                        + ", ".join(m.id if m is not None else "the broadcast" for m in waiting.values())]
        if not failures:
            return
        why = f"bucket {index}: " + "; ".join(failures)
        cancel.set()
        if on_failure is not None:
            on_failure(why)
        found = watcher.exception() if watcher in finished else None
        hung = found.ids if isinstance(found, MembersHung) else set()
        for fut, m in list(waiting.items()):  # a hung member will not confirm: the grace is for the others
            if isinstance(m, Member) and m.id in hung:
                fut.cancel()
                del waiting[fut]
                m.error, m.stuck = m.error or "hung while loading", True
        more = self._settle(waiting, await self._wait(waiting, self.reply_grace_s, stop_on_error=False))
        for fut, m in waiting.items():  # still silent after the grace: give up on them
            fut.cancel()
            if m is not None:
                m.error, m.stuck = m.error or "no answer", True
        raise WeightSyncError("; ".join([why, *more]))

    @staticmethod
    async def _liveness(waiting: dict[asyncio.Future, Any]) -> None:
        """Raise once a member whose bucket call is pending stops answering ``/model_info``."""
        while True:
            await asyncio.sleep(LIVENESS_INTERVAL_S)
            loading = [m for f, m in list(waiting.items()) if isinstance(m, Member) and not f.done()]

            async def probe(m: Member) -> str | None:
                try:
                    await m.client.model_info(timeout_s=LIVENESS_TIMEOUT_S)
                except EngineError as exc:
                    return f"{m.id}: stopped answering while loading (/model_info: {exc})"
                return None

            answers = await asyncio.gather(*(probe(m) for m in loading))
            hung = {m.id: why for m, why in zip(loading, answers) if why}
            if hung:
                raise MembersHung(set(hung), "; ".join(hung.values()))

    @staticmethod
    async def _wait(waiting: dict[asyncio.Future, Any], timeout_s: float, stop_on_error: bool,
                    optional: asyncio.Future | None = None) -> list[asyncio.Future]:
        """Wait for the calls in ``waiting`` (all but ``optional``, or until one fails); the finished ones."""
        loop = asyncio.get_running_loop()
        deadline, finished = loop.time() + timeout_s, []
        pending = set(waiting)
        while pending - {optional}:
            done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            finished.extend(done)
            if stop_on_error and any(f.exception() is not None for f in done):
                break
        return finished

    @staticmethod
    def _settle(waiting: dict[asyncio.Future, Any], finished: list[asyncio.Future]) -> list[str]:
        """Account finished calls (removing them from ``waiting``); their failures, named."""
        failures = []
        for fut in finished:
            m = waiting.pop(fut)
            exc = fut.exception()
            if exc is None:
                if m is not None:
                    m.confirmed += 1
            elif m is LIVENESS:
                failures.append(str(exc))
            elif m is None:
                failures.append(f"broadcast: {exc}")
            else:
                m.error = str(exc)
                failures.append(f"{m.id}: {exc}")
        return failures

    # -- after the buckets ---------------------------------------------------------------------
    async def end(self) -> None:
        """Close every open session; raises naming the engines whose close failed (they may
        not have finalised the new weights)."""
        async def one(m: Member) -> None:
            try:
                await m.client.end_weight_update(timeout_s=self.control_timeout_s)
            finally:
                m.session = False

        failed = await self.each(one, self.control_timeout_s, [m for m in self.members if m.session and not m.stuck])
        for m in self.members:
            if failed.get(m.id) is not None:
                m.error = m.error or f"end_weight_update: {failed[m.id]}"
        if _errors(failed):
            raise WeightSyncError(f"end_weight_update failed: {_errors(failed)}")

    async def check_weights(self) -> dict[str, str]:
        """``/weights_checker`` on every member that loaded the whole update. Members whose
        weights disagree with the others' (:mod:`asyncrl.sync_control.weights_check`) get an
        error (their outcome is ``mixed``); returns them (id → why). Raises when a layout has
        no strict majority (nothing says which members are right); an outvoted minority does
        not fail the update: the caller takes those members out."""
        members = [m for m in self.members if not m.stuck and self.outcome(m) == "loaded"]
        if len(members) < 2:
            return {}  # nothing to compare with
        checks: dict[str, WeightsCheck | None] = {}

        async def one(m: Member) -> None:
            if m.weights_kind is None:  # an adapter sync reads no layouts
                layout = EngineLayout.from_server_info(m.id, await m.client.server_info(timeout_s=self.control_timeout_s))
                m.release, m.weights_kind = layout.version, layout.weights_kind
            checks[m.id] = await m.client.check_weights(timeout_s=self.control_timeout_s)

        failed = await self.each(one, 2 * self.control_timeout_s + REPLY_SLACK_S, members)
        if _errors(failed):
            log.warning("weights check failed (those engines are not compared): %s", _errors(failed))
        answered = {eid: c for eid, c in checks.items() if c is not None}
        verdict = disagreeing(answered, {m.id: m.weights_kind for m in members})
        if verdict.not_judged:
            log.info("weights check: not judged (nothing to compare with): %s",
                     "; ".join(f"{e}: {w}" for e, w in sorted(verdict.not_judged.items())))
        bad = verdict.all
        for m in members:
            if m.id in bad:
                m.error = m.error or f"weights_checker: {bad[m.id]}"
        if verdict.undecided:
            raise WeightSyncError("engines hold different weights after the update: "
                                  + "; ".join(f"{eid}: {why}" for eid, why in sorted(bad.items())))
        if bad:
            log.error("engines outvoted by the weights check (mixed): %s", "; ".join(f"{e}: {w}" for e, w in sorted(bad.items())))
        elif len(answered) > 1:
            log.info("weights check: %d engines agree", len(answered))
        return bad

    async def flush(self, retries: int = FLUSH_RETRIES) -> None:
        """Best effort: a cache left unflushed keeps prefix KV of the old weights (prefix hits
        after the sync reuse it). ``retries``: 0 no call; 1 one immediate call (a paused engine
        holding retracted requests flushes only this way, 0.5.21+); more: one call in which the
        engine waits up to ``retries × FLUSH_INTERVAL_S`` for its aborted requests to drain
        (``/flush_cache?timeout=``), instead of as many round trips."""
        if retries <= 0:
            return
        wait_s = retries * FLUSH_INTERVAL_S if retries > 1 else 0.0
        failed = await self.each(lambda m: m.client.flush_cache(retries=1, timeout_s=self.control_timeout_s, wait_s=wait_s),
                                 wait_s + self.control_timeout_s + REPLY_SLACK_S)
        if _errors(failed):
            log.warning("flush_cache failed: %s", _errors(failed))

    async def resume(self) -> None:
        """``/continue_generation`` on every member paused here (not a stuck one); failures
        are logged (never raised: this runs in ``finally``)."""
        failed = await self.each(lambda m: m.client.resume(timeout_s=self.control_timeout_s), self.control_timeout_s,
                                  [m for m in self.members if m.paused and not m.stuck])
        for m in self.members:
            if m.paused and failed.get(m.id) is None:
                m.paused = False
        if _errors(failed):
            log.error("continue_generation failed: %s", _errors(failed))

    async def leave_group(self, group_name: str | None = None) -> None:
        """``/destroy_weights_update_group`` of this update's group (or ``group_name``: a
        previous one) on every member that answers (best effort: after a failure the group is
        dropped everywhere and the next sync forms a new one, under a new name)."""
        name = group_name or self.group_name
        await self.each(lambda m: m.client.destroy_weights_update_group(name, timeout_s=self.control_timeout_s),
                        self.control_timeout_s, [m for m in self.members if not m.stuck])

    async def release(self) -> None:
        """After a failure: close sessions left open, then resume (both best effort). A stuck
        member is left as it is (paused, session open): whoever quarantined it repairs it once
        it answers again (the sync agent's reconcile loop)."""
        try:
            if any(m.session and not m.stuck for m in self.members):
                await self.end()
        except (WeightSyncError, EngineError) as exc:
            log.warning("closing weight-update sessions after a failure: %s", exc)
        await self.resume()

    def outcome(self, member: Member) -> str:
        """``loaded`` | ``mixed`` | ``unchanged`` (module docstring)."""
        if member.sent == 0:
            return "unchanged"
        if member.confirmed == max(self.buckets, self.total_buckets) and member.error is None:
            return "loaded"
        return "mixed"
