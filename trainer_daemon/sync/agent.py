"""``SyncAgentPublisher``: the trainer's side of the sync agent's protocol (the agent itself
lands with issue 6; ``tests/trainer/fake_sync_agent.py`` implements this contract for tests).

Per publish, on the trainer's I/O loop:

1. ``POST {sync.url}/v1/syncs`` with ``Authorization: Bearer <security.sync_token>`` and JSON::

       {"version": 3,
        "group": {"master_address": "127.0.0.1", "master_port": 41234, "backend": "gloo",
                  "world_size": 2, "group_name": "weight_update_group", "new": false},
        "buckets": [{"names": [...], "dtypes": ["float32", ...], "shapes": [[...], ...]}, ...],
        "flattened": true}

   ``world_size`` is sent when the trainer knows it (``1 + engines × engines.gpus_per_engine``
   from the config) and omitted otherwise; the agent may then put ``"world_size"`` in its
   answer. ``new`` is true when the trainer hosts a fresh group for this sync. Expected answer:
   ``202 {"id": "<sync id>", "world_size"?: int, "join_group"?: bool}`` within
   ``SYNC_REQUEST_TIMEOUT_S``; anything else fails the sync. ``join_group`` (optional) must equal
   ``new``; if not, or on ``409 {"error": {"code": "regroup"}}``, the trainer drops its group and
   the next sync forms a new one on a new port.
2. The first time (and after a failure broke the group) the trainer hosts the group's store
   on ``master_port`` (reserved and listening *before* the POST) and joins as rank 0; the agent
   has the engines join (``/init_weights_update_group`` with ``rank_offset`` ≥ 1). Later bodies
   carry the same group: the agent knows it exists. A body whose group the agent does not know
   (new port) means: form it.
3. The trainer broadcasts the buckets in the body's order, each as one flattened broadcast;
   each broadcast returns once every engine entered it. The first one waits up to
   ``sync.pause_timeout_s + sync.broadcast_timeout_s`` (the agent pauses the rollout first),
   later ones ``sync.broadcast_timeout_s``. A timeout fails the sync; the broken group is
   destroyed and the next sync forms a new one (new port).
4. The trainer does not wait for rollout to resume: ``publish`` returns after the last
   broadcast, and a background task polls ``GET {sync.url}/v1/syncs/{id}`` (bearer token) every
   ``POLL_INTERVAL_S`` until ``{"state": "succeeded" | "failed", ...}`` or ``POLL_BUDGET_S``,
   for metrics (``trainer/sync_agent_failures``) and logs only.

The agent owns everything else: pausing and resuming the rollout service, flushing caches,
``weight_version`` on the engines, quarantining an engine that failed half-way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import aiohttp
import torch

from asyncrl.weight_sync import (
    DEFAULT_GROUP_NAME,
    WeightGroup,
    WeightSyncError,
    plan_buckets,
    reserve_listen_socket,
)
from trainer_daemon.sync.base import WeightPublisher, weights_nbytes
from trainer_daemon.sync.flat import FlatBuffers, send_buckets
from trainer_daemon.sync.group import init_group

log = logging.getLogger(__name__)

SYNC_REQUEST_TIMEOUT_S = 30.0  # the agent answers 202 before doing any work
POLL_INTERVAL_S = 1.0
POLL_BUDGET_S = 600.0  # stop asking about a sync after this; it is metrics only
TERMINAL_STATES = ("succeeded", "failed")


class SyncAgentPublisher(WeightPublisher):
    """See the module docstring."""

    name = "sync_agent"

    def __init__(self, url: str, token: str | None, *, master_address: str, master_port: int = 0, backend: str = "gloo",
                 world_size: int | None, bucket_bytes: int, group_timeout_s: float, pause_timeout_s: float,
                 broadcast_timeout_s: float, group_name: str = DEFAULT_GROUP_NAME) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.world_size, self.bucket_bytes, self.group_name = world_size, bucket_bytes, group_name
        self.group_timeout_s, self.pause_timeout_s, self.broadcast_timeout_s = group_timeout_s, pause_timeout_s, broadcast_timeout_s
        self.group: WeightGroup | None = None
        self.buffers = FlatBuffers()
        self._sock = None
        self._group_info: dict | None = None
        self._session: aiohttp.ClientSession | None = None
        self._polls: set[asyncio.Task] = set()
        self.agent_failures = 0
        self.agent_states: dict[str, str] = {}

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    def _reset_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.destroy()
        elif self._sock is not None:
            self._sock.close()
        self._sock, self._group_info = None, None

    async def _request(self, version: int, buckets, forming: bool) -> tuple[str, int | None]:
        body = {"version": version, "group": {**self._group_info, "new": forming}, "flattened": True,
                "buckets": [b.http_fields() for b in buckets]}
        try:
            async with self._http().post(f"{self.url}/v1/syncs", json=body, headers=self._headers(),
                                         timeout=aiohttp.ClientTimeout(total=SYNC_REQUEST_TIMEOUT_S)) as resp:
                text = await resp.text()
                if resp.status != 202:
                    if resp.status == 409 and '"regroup"' in text:  # the agent's engines changed: new group, new port
                        self._reset_group()
                    raise WeightSyncError(f"sync agent answered {resp.status}: {text[:500]}")
                reply = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WeightSyncError(f"POST {self.url}/v1/syncs failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(reply, dict) or not reply.get("id"):
            raise WeightSyncError(f"sync agent's 202 carries no id: {reply!r}")
        join = reply.get("join_group")
        if join is not None and bool(join) != forming:
            self._reset_group()  # the agent lost (or refused) our group: the next sync forms a new one
            raise WeightSyncError(f"sync agent answered join_group={join} for a group the trainer {'forms' if forming else 'already formed'}")
        ws = reply.get("world_size")
        return str(reply["id"]), (int(ws) if ws is not None else None)

    async def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> dict[str, float]:
        t0 = time.perf_counter()
        buckets = plan_buckets(weights, self.bucket_bytes)
        forming = self.group is None
        if forming:
            self._sock = reserve_listen_socket(self.master_address, self.master_port)
            self._group_info = {"master_address": self.master_address, "master_port": self._sock.getsockname()[1],
                                "backend": self.backend, "group_name": self.group_name}
            if self.world_size:
                self._group_info["world_size"] = self.world_size
        try:
            sync_id, agent_ws = await self._request(version, buckets, forming)
            t1 = time.perf_counter()
            if forming:
                world = agent_ws or self.world_size
                if not world:
                    raise WeightSyncError("world size unknown: set engines.urls or have the agent answer world_size")
                self.group = await asyncio.to_thread(
                    init_group, self.master_address, self._group_info["master_port"], world, backend=self.backend,
                    group_name=self.group_name, timeout_s=self.pause_timeout_s + self.group_timeout_s, listen_socket=self._sock)
            t2 = time.perf_counter()
            async def send(i: int, bucket, flat: torch.Tensor) -> None:
                if self.backend == "nccl":
                    flat = flat.cuda(non_blocking=True)
                limit = self.broadcast_timeout_s + (self.pause_timeout_s if i == 0 and not forming else 0.0)
                await asyncio.to_thread(self.group.broadcast, flat, 0, limit)

            await send_buckets(buckets, weights, self.buffers, send)
            t3 = time.perf_counter()
        except BaseException:
            if self.group is None or self.group.broken:
                self._reset_group()
            raise
        task = asyncio.create_task(self._poll(sync_id, version))
        self._polls.add(task)
        task.add_done_callback(self._polls.discard)
        nbytes = weights_nbytes(weights)
        return {
            "trainer/sync_bytes": float(nbytes), "trainer/sync_buckets": float(len(buckets)),
            "timing_s/sync_request": t1 - t0, "timing_s/sync_group": t2 - t1, "timing_s/sync_broadcast": t3 - t2,
            "trainer/sync_gb_per_s": nbytes / 1e9 / max(t3 - t2, 1e-9),
            "trainer/sync_agent_failures": float(self.agent_failures),
        }

    async def _poll(self, sync_id: str, version: int) -> None:
        deadline = time.monotonic() + POLL_BUDGET_S
        while time.monotonic() < deadline:
            await asyncio.sleep(POLL_INTERVAL_S)
            try:
                async with self._http().get(f"{self.url}/v1/syncs/{sync_id}", headers=self._headers(),
                                            timeout=aiohttp.ClientTimeout(total=SYNC_REQUEST_TIMEOUT_S)) as resp:
                    body = await resp.json(content_type=None) if resp.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.debug("polling sync %s: %s", sync_id, exc)
                continue
            state = str((body or {}).get("state", ""))
            if state in TERMINAL_STATES:
                self.agent_states[sync_id] = state
                if state == "failed":
                    self.agent_failures += 1
                    log.error("sync agent reports sync %s (version %d) failed: %s", sync_id, version, (body or {}).get("error"))
                return
        log.warning("sync %s (version %d): no final state from the agent within %.0f s", sync_id, version, POLL_BUDGET_S)

    async def close(self) -> None:
        for t in list(self._polls):
            t.cancel()
        await asyncio.gather(*self._polls, return_exceptions=True)
        self._reset_group()
        if self._session is not None:
            await self._session.close()
