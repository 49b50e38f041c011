"""``SyncAgentPublisher``: the trainer's side of the sync agent's protocol (``asyncrl.wire.sync``).

Per publish, on the trainer's I/O loop:

1. ``POST {sync.url}/v1/syncs`` (bearer ``security.sync_token``) with a
   :class:`~asyncrl.wire.sync.SyncRequest`: the version, the group the trainer hosts (``new``
   when it hosts a fresh one on a freshly reserved port, with its NCCL and torch versions) and
   the buckets. Expected: ``202`` :class:`~asyncrl.wire.sync.SyncAccepted` within
   ``SYNC_REQUEST_TIMEOUT_S``; anything else fails the sync. ``join_group`` must equal ``new``;
   if not, or on ``409`` with reason ``regroup``, the trainer drops its group and the next sync
   forms a new one on a new port.
2. A watcher polls ``GET /v1/syncs/{id}`` every ``WATCH_INTERVAL_S`` from then on. When the agent
   reports ``failing`` or ``failed`` (an engine refused a bucket, an engine died, the pause
   failed) it cancels whatever the trainer is waiting for at once: hosting the group or a
   broadcast. Without it the trainer would sit in a collective until its timeout.
3. When forming, the trainer hosts the group (rank 0) for ``accepted.world_size`` ranks; then
   it broadcasts the buckets in order (the packed bytes of each). The first broadcast waits up
   to ``sync.pause_timeout_s`` more (the agent pauses the rollout first); with a new group the
   first bucket is the smallest tensor alone, under ``sync.group_init_timeout_s``.
4. After the last broadcast ``publish`` waits for the sync's *outcome*, the agent's final state
   (bounded by ``sync.pause_timeout_s + sync.broadcast_timeout_s``: ending the engines' update
   sessions, setting their version, resuming): it returns only when the agent reports
   ``succeeded``, and raises :class:`WeightSyncError` when the agent rolled the sync back or
   gave no outcome in time. So the trainer's weight version (and its staleness accounting) is
   the version the engines reached, never one a broadcast merely delivered.

The agent owns everything else: pausing and resuming the rollout service and the engines,
weight-update sessions, the version on the engines, quarantining engines left mixed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import aiohttp
import torch
from pydantic import ValidationError

from asyncrl import failpoints
from asyncrl.http.keepalive import client_session
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.weight_sync import (
    WeightGroup,
    host_group_async,
    reserve_listen_socket,
)
from asyncrl.wire.sync import (
    DEFAULT_GROUP_NAME,
    AgentStatus,
    GroupSpec,
    SyncAccepted,
    SyncRefusal,
    SyncRequest,
    SyncStatus,
    fresh_group_name,
)
from trainer_daemon.policy.lora import AdapterSnapshot
from trainer_daemon.sync.adapter import adapter_spec
from trainer_daemon.sync.base import (
    StaleVersion,
    WeightPublisher,
    trainer_nccl_versions,
)
from trainer_daemon.sync.flat import (
    FlatBuffers,
    Weights,
    broadcast_flat,
    discard,
    plan_for,
    send_buckets,
    weights_nbytes,
)

log = logging.getLogger(__name__)

SYNC_REQUEST_TIMEOUT_S = 30.0  # the agent answers 202 before doing any work
WATCH_INTERVAL_S = 0.25  # while broadcasting: how soon an engine's refusal stops the trainer
POLL_INTERVAL_S = 1.0  # after the broadcasts: the final state is for metrics only
POLL_BUDGET_S = 600.0


def sync_outcome_metrics(final: SyncStatus) -> dict[str, float]:
    """What the agent's final status adds to the step's metrics: the pause window as the agent
    timed it (``timing_s/sync_pausing``) and a ``per_request`` pause's decisions
    (``fully_async/per_request/*``: calls kept, resumed, cancelled, missed; tokens re-prefilled
    and decoded by cancelled trajectories; docs/sync_agent.md, "Per-request pauses")."""
    out = {"timing_s/sync_pausing": float(final.phase_seconds.get("pausing", 0.0))}
    p = final.pause_outcome
    if p is not None:
        out.update({f"fully_async/per_request/{k}": float(getattr(p, k))
                    for k in ("kept", "resumed", "cancelled", "missed", "reprefill_tokens", "cancelled_tokens")})
    return out


class SyncAgentPublisher(WeightPublisher):
    """See the module docstring."""

    name = "sync_agent"

    def __init__(self, url: str, token: str | None, *, master_address: str, master_port: int = 0, backend: str = "gloo",
                 bucket_bytes: int, group_timeout_s: float, pause_timeout_s: float, broadcast_timeout_s: float,
                 group_name: str = DEFAULT_GROUP_NAME, adapters: dict | None = None) -> None:
        self.url = url.rstrip("/")
        self.adapters = adapters
        """``adapter_spec``'s keywords (``run_id``, ``transport``, ``adapter_dir``) for adapter syncs."""
        self.token = token
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.bucket_bytes, self.group_base, self.group_name = bucket_bytes, group_name, group_name
        self.group_timeout_s, self.pause_timeout_s, self.broadcast_timeout_s = group_timeout_s, pause_timeout_s, broadcast_timeout_s
        self.group: WeightGroup | None = None
        self.spec: GroupSpec | None = None
        self.buffers = FlatBuffers()
        self._session: aiohttp.ClientSession | None = None
        self._watchers: set[asyncio.Task] = set()
        self.agent_failures = 0
        self.agent_states: dict[str, str] = {}
        self._group_dropped = False  # a failed sync makes the agent drop the group: form a new one next time

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = client_session()
        return self._session

    def _reset_group(self) -> None:
        group, self.group, self.spec = self.group, None, None
        self.buffers.drop()
        if group is not None:
            group.destroy()

    async def _post(self, request: SyncRequest) -> SyncAccepted:
        try:
            async with self._http().post(f"{self.url}/v1/syncs", json=request.model_dump(), headers=self._headers(),
                                         timeout=aiohttp.ClientTimeout(total=SYNC_REQUEST_TIMEOUT_S)) as resp:
                text = await resp.text()
                if resp.status != 202:
                    refusal = SyncRefusal.parse(resp.status, text)
                    if refusal is not None and refusal.reason == "regroup":  # the agent's engines changed: new group, new port
                        self._reset_group()
                    if refusal is not None and refusal.reason == "stale" and refusal.current_version is not None:
                        raise StaleVersion(f"sync agent answered 409 stale: {text[:500]}", refusal.current_version)
                    if refusal is not None:  # the whole reason: it names every engine and the flag to add
                        raise WeightSyncError(f"sync agent answered {resp.status} {refusal.reason}: {refusal.message[:4000]}")
                    raise WeightSyncError(f"sync agent answered {resp.status}: {text[:500]}")
                accepted = SyncAccepted.model_validate_json(text)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WeightSyncError(f"POST {self.url}/v1/syncs failed: {type(exc).__name__}: {exc}") from exc
        except ValidationError as exc:
            raise WeightSyncError(f"sync agent's 202 is not a SyncAccepted: {exc}") from exc
        if request.group is not None and accepted.join_group != request.group.new:
            self._reset_group()  # the agent lost (or refused) our group: the next sync forms a new one
            raise WeightSyncError(f"sync agent answered join_group={accepted.join_group} for a group the trainer "
                                  f"{'forms' if request.group.new else 'already formed'}")
        return accepted

    async def _agent_status(self) -> AgentStatus | None:
        try:
            async with self._http().get(f"{self.url}/status", headers=self._headers(),
                                        timeout=aiohttp.ClientTimeout(total=SYNC_REQUEST_TIMEOUT_S)) as resp:
                return AgentStatus.model_validate_json(await resp.read()) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValidationError) as exc:
            log.warning("asking the sync agent for its status: %s", exc)
            return None

    async def current_version(self) -> int | None:
        """The agent's version (what the engines serve, or a sync it accepted); None if unreachable."""
        status = await self._agent_status()
        return None if status is None else status.newest_version

    async def push_wanted(self) -> bool:
        status = await self._agent_status()
        return status is not None and status.push_wanted

    async def _status(self, sync_id: str) -> SyncStatus | None:
        try:
            async with self._http().get(f"{self.url}/v1/syncs/{sync_id}", headers=self._headers(),
                                        timeout=aiohttp.ClientTimeout(total=SYNC_REQUEST_TIMEOUT_S)) as resp:
                return SyncStatus.model_validate_json(await resp.read()) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValidationError) as exc:
            log.debug("polling sync %s: %s", sync_id, exc)
            return None

    async def _watch(self, sync_id: str, version: int, cancel: threading.Event, why: list[str],
                     publishing: asyncio.Event) -> SyncStatus | None:
        """Poll the sync until it is final; its final status (None: no answer within the budget)."""
        deadline = time.monotonic() + POLL_BUDGET_S
        while time.monotonic() < deadline:
            await asyncio.sleep(WATCH_INTERVAL_S if publishing.is_set() else POLL_INTERVAL_S)
            status = await self._status(sync_id)
            if status is None:
                continue
            if status.failing and not cancel.is_set():
                why.append(status.error or status.state)
                cancel.set()
            if status.state in ("succeeded", "failed"):
                self.agent_states[sync_id] = status.state
                if status.state == "failed":
                    self.agent_failures += 1
                    self._group_dropped = True
                    log.error("sync agent reports sync %s (version %d) failed: %s", sync_id, version, status.error)
                return status
        log.warning("sync %s (version %d): no final state from the agent within %.0f s", sync_id, version, POLL_BUDGET_S)
        return None

    async def _host(self, port: int, world: int, sock, cancel: threading.Event) -> WeightGroup:
        """Host the group in a thread; stop waiting (the thread finishes on its own timeout and
        its group, if it ever forms, is destroyed) when the agent gives up."""
        task = asyncio.ensure_future(host_group_async(
            self.master_address, port, world, backend=self.backend, group_name=self.group_name,
            timeout_s=self.pause_timeout_s + self.group_timeout_s, listen_socket=sock))
        while not task.done():
            await asyncio.wait({task}, timeout=WATCH_INTERVAL_S)
            if cancel.is_set() and not task.done():
                task.add_done_callback(lambda t: t.exception() is None and t.result().destroy())
                raise WeightSyncError("the sync agent gave up while the trainer hosted the group")
        return task.result()

    async def publish(self, version: int, weights: Weights | AdapterSnapshot) -> dict[str, float]:
        if isinstance(weights, AdapterSnapshot):
            return await self._publish_adapter(version, weights)
        t0 = time.perf_counter()
        if self._group_dropped:
            self._group_dropped = False
            self._reset_group()
        forming = self.group is None
        buckets = plan_for(weights, self.bucket_bytes, first_tiny=forming)
        sock = None
        if forming:
            sock = reserve_listen_socket(self.master_address, self.master_port)
            nccl, torch_version = trainer_nccl_versions()
            self.group_name = fresh_group_name(self.group_base)
            self.spec = GroupSpec(master_address=self.master_address, master_port=sock.getsockname()[1], backend=self.backend,
                                  group_name=self.group_name, new=True, nccl_version=nccl, torch_version=torch_version)
        spec = self.spec.model_copy(update={"new": forming})
        cancel, why, publishing = threading.Event(), [], asyncio.Event()
        accepted = None
        try:
            accepted = await self._post(SyncRequest(version=version, group=spec, buckets=[b.spec() for b in buckets]))
            publishing.set()
            watcher = asyncio.create_task(self._watch(accepted.id, version, cancel, why, publishing))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
            t1 = time.perf_counter()
            if forming:
                self.group = await self._host(spec.master_port, accepted.world_size, sock, cancel)
                sock = None
            t2 = time.perf_counter()
            group = self.group

            async def send(i: int, bucket, flat: torch.Tensor) -> None:
                if i == 0:
                    limit = self.pause_timeout_s + (self.group_timeout_s if forming else self.broadcast_timeout_s)
                else:
                    limit = self.broadcast_timeout_s
                    await failpoints.hold_async("trainer.sync_bucket")  # fault tests: engines mixed while it holds
                await broadcast_flat(group, flat, limit, cancel)

            await send_buckets(buckets, weights, self.buffers, send)
            t3 = time.perf_counter()
            outcome_s = self.pause_timeout_s + self.broadcast_timeout_s
            try:
                final = await asyncio.wait_for(asyncio.shield(watcher), outcome_s)
            except TimeoutError:
                raise WeightSyncError(f"broadcast done, but the sync agent gave no outcome for sync {accepted.id} within "
                                      f"{outcome_s:.0f} s: counted as failed") from None
            if final is None or final.state != "succeeded":
                raise WeightSyncError(f"broadcast done, but the sync agent did not complete sync {accepted.id}: "
                                      f"{final.error if final is not None else 'no final state'}")
            t4 = time.perf_counter()
        except BaseException as exc:
            discard(weights)  # an aborted broadcast may still read packed buffers
            if sock is not None:
                sock.close()
            if forming or self.group is None or self.group.broken:
                self._reset_group()
            if isinstance(exc, WeightSyncError) and accepted is not None and not why:
                status = await self._status(accepted.id)  # a broadcast that broke on its own: say why if the agent knows
                if status is not None and status.failing:
                    why.append(status.error or status.state)
            if why and isinstance(exc, WeightSyncError):
                raise WeightSyncError(f"the sync agent stopped the sync: {why[0]} ({exc})") from exc
            raise
        finally:
            publishing.clear()
        nbytes = weights_nbytes(weights)
        return {
            "trainer/sync_bytes": float(nbytes), "trainer/sync_buckets": float(len(buckets)),
            "timing_s/sync_request": t1 - t0, "timing_s/sync_group": t2 - t1, "timing_s/sync_broadcast": t3 - t2,
            "timing_s/sync_outcome": t4 - t3,
            "trainer/sync_gb_per_s": nbytes / 1e9 / max(t3 - t2, 1e-9),
            "trainer/sync_agent_failures": float(self.agent_failures),
            **sync_outcome_metrics(final),
        }

    async def _publish_adapter(self, version: int, snapshot: AdapterSnapshot) -> dict[str, float]:
        """An adapter sync (``trainer_daemon.sync.adapter``): post the adapter itself, then wait
        for the agent's outcome, as after the broadcasts of a weight sync."""
        if self.adapters is None:
            raise WeightSyncError("this publisher was not given an adapter setup (run id, transport, directory)")
        t0 = time.perf_counter()
        spec = await asyncio.to_thread(adapter_spec, snapshot, version, **self.adapters)
        t1 = time.perf_counter()
        accepted = await self._post(SyncRequest(version=version, adapter=spec))
        why: list[str] = []
        outcome_s = self.pause_timeout_s + self.broadcast_timeout_s
        try:
            watching = asyncio.Event()
            watching.set()  # the whole sync takes well under a second: poll at the broadcast's pace
            final = await asyncio.wait_for(self._watch(accepted.id, version, threading.Event(), why, watching), outcome_s)
        except TimeoutError:
            raise WeightSyncError(f"the sync agent gave no outcome for adapter sync {accepted.id} within {outcome_s:.0f} s") from None
        if final is None or final.state != "succeeded":
            raise WeightSyncError(f"the sync agent did not complete adapter sync {accepted.id}: "
                                  f"{final.error if final is not None else 'no final state'}")
        return {"trainer/sync_bytes": float(snapshot.nbytes), "trainer/sync_buckets": 0.0,
                "timing_s/sync_request": t1 - t0, "timing_s/sync_outcome": time.perf_counter() - t1,
                "trainer/sync_agent_failures": float(self.agent_failures), **sync_outcome_metrics(final)}

    async def close(self) -> None:
        for t in list(self._watchers):
            t.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self._reset_group()
        if self._session is not None:
            await self._session.close()
