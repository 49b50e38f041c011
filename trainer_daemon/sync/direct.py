"""``DirectEnginePublisher``: the trainer drives the engines itself, no sync agent needed.

Per publish (contract §5.3, slime's order), on the trainer's I/O loop:

1. the weight group is formed once per trainer lifetime (re-formed after a failed broadcast
   broke it; the engines' old group is destroyed first, best effort);
2. ``pause_generation`` on every engine (``abort`` mode: in-flight requests come back as
   aborted and the rollout service resumes them as partial rollouts), then ``flush_cache``;
3. every bucket (``plan_buckets`` of ``sync.bucket_bytes``, one dtype each, sent as one
   ``flattened_bucket`` broadcast from a reused buffer, ``sync/flat.py``): the HTTP call is
   fired first, then the broadcast, then the replies are collected; ``weight_version`` goes
   with the last bucket only, so an engine whose update failed half-way still reports the old
   version (and local_engine/SGLang-side checks mark its weights inconsistent);
4. ``continue_generation`` on every engine — in a ``finally``, so an engine is never left paused.

Timeouts: pause/flush/continue ``engines.control_timeout_s`` each, group ``sync.group_init_timeout_s``,
each bucket ``sync.broadcast_timeout_s``.

Use it for tests, single-machine runs and clusters without a sync agent. What it cannot do
that the agent will: pause the rollout service's admission (drain mode, ``partial_rollout=false``)
and quarantine an engine left with mixed weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

import torch

from asyncrl.engine_client import EngineClient
from asyncrl.weight_sync import DEFAULT_GROUP_NAME, WeightGroup, WeightSyncError, plan_buckets
from trainer_daemon.sync.base import WeightPublisher, weights_nbytes
from trainer_daemon.sync.flat import FlatBuffers, push_flat_bucket, send_buckets
from trainer_daemon.sync.group import form_group

log = logging.getLogger(__name__)

FLUSH_RETRIES = 30  # flush_cache answers 400 while aborted requests drain; retried this many times
FLUSH_INTERVAL_S = 0.2


class DirectEnginePublisher(WeightPublisher):
    """See the module docstring."""

    name = "direct"

    def __init__(self, engines: Sequence[EngineClient], *, master_address: str, master_port: int = 0,
                 backend: str = "gloo", ranks_per_engine: int = 1, bucket_bytes: int, group_timeout_s: float,
                 broadcast_timeout_s: float, control_timeout_s: float, pause_mode: str = "abort",
                 group_name: str = DEFAULT_GROUP_NAME) -> None:
        if not engines:
            raise ValueError("DirectEnginePublisher needs at least one engine (engines.urls)")
        self.engines = list(engines)
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.ranks_per_engine, self.group_name = backend, ranks_per_engine, group_name
        self.bucket_bytes = bucket_bytes
        self.group_timeout_s, self.broadcast_timeout_s = group_timeout_s, broadcast_timeout_s
        self.control_timeout_s, self.pause_mode = control_timeout_s, pause_mode
        self.group: WeightGroup | None = None
        self.buffers = FlatBuffers()

    async def _all(self, what: str, calls) -> None:
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [f"engine {i}: {r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            raise WeightSyncError(f"{what} failed: " + "; ".join(errors))

    async def _ensure_group(self) -> WeightGroup:
        if self.group is not None and not self.group.broken:
            return self.group
        if self.group is not None:
            await self._drop_group()
        self.group = await form_group(self.engines, self.master_address, self.master_port, backend=self.backend,
                                      ranks_per_engine=self.ranks_per_engine, group_name=self.group_name,
                                      timeout_s=self.group_timeout_s)
        return self.group

    async def _drop_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            await asyncio.to_thread(group.destroy)
        await asyncio.gather(*(e.destroy_weights_update_group(self.group_name, timeout_s=self.control_timeout_s)
                               for e in self.engines), return_exceptions=True)

    async def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> dict[str, float]:
        t0 = time.perf_counter()
        group = await self._ensure_group()
        t1 = time.perf_counter()
        buckets = plan_buckets(weights, self.bucket_bytes)
        try:
            await self._all("pause_generation", [e.pause(self.pause_mode, timeout_s=self.control_timeout_s) for e in self.engines])
            await self._all("flush_cache", [e.flush_cache(retries=FLUSH_RETRIES, interval_s=FLUSH_INTERVAL_S,
                                                          timeout_s=self.control_timeout_s) for e in self.engines])
            t2 = time.perf_counter()
            collective = [0.0]

            async def send(i: int, bucket, flat: torch.Tensor) -> None:
                if self.backend == "nccl":
                    flat = flat.cuda(non_blocking=True)
                collective[0] += await push_flat_bucket(
                    group, self.engines, bucket, flat, timeout_s=self.broadcast_timeout_s,
                    weight_version=str(version) if i == len(buckets) - 1 else None)

            await send_buckets(buckets, weights, self.buffers, send)
            t3 = time.perf_counter()
        except WeightSyncError:
            if group.broken:
                await self._drop_group()
            raise
        finally:
            results = await asyncio.gather(*(e.resume(timeout_s=self.control_timeout_s) for e in self.engines),
                                           return_exceptions=True)
            for i, r in enumerate(results):
                if isinstance(r, BaseException):
                    log.error("continue_generation on engine %d failed: %s", i, r)
        nbytes = weights_nbytes(weights)
        return {
            "trainer/sync_bytes": float(nbytes),
            "trainer/sync_buckets": float(len(buckets)),
            "timing_s/sync_group": t1 - t0,
            "timing_s/sync_pause": t2 - t1,
            "timing_s/sync_broadcast": t3 - t2,
            "timing_s/sync_collective": collective[0],
            "trainer/sync_gb_per_s": nbytes / 1e9 / max(t3 - t2, 1e-9),
            "trainer/sync_collective_gb_per_s": nbytes / 1e9 / max(collective[0], 1e-9),
        }

    async def close(self) -> None:
        try:
            await self._drop_group()
        finally:
            await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)
