"""``DirectEnginePublisher``: the trainer drives the engines itself, no sync agent needed.

Per publish, on the trainer's I/O loop, the engine side is
:func:`asyncrl.sync_control.sequence.run_update` (the sequence the sync agent runs, one owner)
with the trainer as the in-process sender:

1. ``pause_generation`` on every engine in ``pause_mode`` (``abort``: in-flight requests come
   back as aborted and the rollout service resumes them as partial rollouts; ``retract`` /
   ``in_place``: the engines keep them, ``sync.pause_policy``), ``begin_weight_update``;
2. when there is no group (first publish, or a failure broke it): read every engine's layout
   (``/server_info``: ranks = ``tp_size``, refusing layouts SGLang cannot update), then the
   engines join while the trainer hosts the group; the first bucket is then the smallest
   tensor alone (the group's first collective, under ``sync.group_init_timeout_s``);
3. every bucket (``plan_buckets`` of ``sync.bucket_bytes``, packed into reused byte buffers,
   ``sync/flat.py``): engines' update calls and the broadcast run together, and the first
   engine that refuses a bucket cancels the broadcast; ``weight_version`` goes with the last
   bucket only, so an engine whose update failed half-way still reports the old version;
4. ``end_weight_update``, ``flush_cache`` (``flush_retries``: 0 none, 1 immediate, more: the
   engine waits that many × 0.2 s for its aborted requests to drain), and
   ``continue_generation`` in a ``finally`` (after a failure: the group dropped first).

Timeouts: control calls ``engines.control_timeout_s``, group ``sync.group_init_timeout_s``,
each bucket ``sync.broadcast_timeout_s``.

Use it for tests, single-machine runs and clusters without a sync agent. What it cannot do
that the agent does: pause the rollout service's admission (drain mode) and quarantine an
engine left with mixed weights (it logs them; the next full publish rewrites them).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

import torch

from asyncrl.engine_client import EngineClient
from asyncrl.sync_control.engine_update import FLUSH_RETRIES, EngineUpdate, Member
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.sync_control.group_plan import GroupRefused, plan_group
from asyncrl.sync_control.pause_policy import pause_plan
from asyncrl.sync_control.sequence import UpdateSteps, run_update
from asyncrl.weight_sync import (
    WeightGroup,
    host_group_async,
    reserve_listen_socket,
)
from asyncrl.wire.sync import DEFAULT_GROUP_NAME, fresh_group_name
from trainer_daemon.sync.base import WeightPublisher, trainer_nccl_versions
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


class DirectEnginePublisher(WeightPublisher):
    """See the module docstring."""

    name = "direct"

    def __init__(self, engines: Sequence[EngineClient], *, master_address: str, master_port: int = 0,
                 backend: str = "gloo", bucket_bytes: int, group_timeout_s: float, broadcast_timeout_s: float,
                 control_timeout_s: float, pause_mode: str = "abort", flush_retries: int = FLUSH_RETRIES,
                 group_name: str = DEFAULT_GROUP_NAME, check_weights: bool = True) -> None:
        if not engines:
            raise ValueError("DirectEnginePublisher needs at least one engine (engines.urls)")
        self.engines = list(engines)
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.group_name, self.bucket_bytes = backend, group_name, bucket_bytes
        self.group_base = group_name  # each new group: group_base-<hex> (fresh_group_name)
        self.group_timeout_s, self.broadcast_timeout_s = group_timeout_s, broadcast_timeout_s
        self.control_timeout_s, self.pause_mode, self.flush_retries = control_timeout_s, pause_mode, flush_retries
        self.check_weights = check_weights
        self.group: WeightGroup | None = None
        self.offsets: list[int] = []
        self.buffers = FlatBuffers()

    def _update(self, total_buckets: int = 0) -> EngineUpdate:
        members = [Member(e.base_url, e, rank_offset=self.offsets[i] if self.offsets else 1)
                   for i, e in enumerate(self.engines)]
        return EngineUpdate(members, control_timeout_s=self.control_timeout_s, total_buckets=total_buckets,
                            group_name=self.group_name)

    async def _form(self, update: EngineUpdate, names: list[str]) -> None:
        self.group_name = update.group_name = fresh_group_name(self.group_base)
        try:
            _, world = await plan_group(update, pause_plan(self.pause_mode, True), names, backend=self.backend,
                                        nccl_versions=trainer_nccl_versions() if self.backend == "nccl" else None)
        except GroupRefused as exc:
            raise WeightSyncError(exc.message) from None
        sock = reserve_listen_socket(self.master_address, self.master_port)
        port = sock.getsockname()[1]

        async def host() -> WeightGroup:
            try:
                return await host_group_async(self.master_address, port, world, backend=self.backend,
                                              group_name=self.group_name, timeout_s=self.group_timeout_s, listen_socket=sock)
            except BaseException:
                sock.close()
                raise

        self.group = await update.join(self.master_address, port, world, backend=self.backend,
                                       timeout_s=self.group_timeout_s, host=host)
        self.offsets = [m.rank_offset for m in update.members]

    async def _drop_group(self, update: EngineUpdate) -> None:
        group, self.group = self.group, None
        self.buffers.drop()
        if group is not None:
            await asyncio.to_thread(group.destroy)
        await update.leave_group()

    async def publish(self, version: int, weights: Weights) -> dict[str, float]:
        t0 = time.perf_counter()
        forming = self.group is None
        buckets = plan_for(weights, self.bucket_bytes, first_tiny=forming)
        update = self._update(len(buckets))
        collective = [0.0]
        marks: dict[str, float] = {}

        async def load() -> None:
            async def send(i: int, bucket, flat: torch.Tensor) -> None:
                limit = self.group_timeout_s if forming and i == 0 else self.broadcast_timeout_s

                async def sender(cancel: threading.Event) -> None:
                    start = time.perf_counter()
                    await broadcast_flat(self.group, flat, limit, cancel)
                    collective[0] += time.perf_counter() - start

                await update.load(bucket.spec(), weight_version=version if i == len(buckets) - 1 else None,
                                  timeout_s=limit, send=sender)

            await send_buckets(buckets, weights, self.buffers, send)

        async def contain(_: BaseException) -> None:
            discard(weights)  # an aborted broadcast may still read packed buffers
            mixed = [m.id for m in update.members if update.outcome(m) == "mixed"]
            if mixed:
                log.error("weight sync to version %d failed; engines that may hold mixed weights until the next full "
                          "publish: %s", version, ", ".join(mixed))
            await self._drop_group(update)

        steps = UpdateSteps(load=load, form=(lambda: self._form(update, [n for b in buckets for n in b.names])) if forming else None,
                            phase=lambda phase: marks.setdefault(phase, time.perf_counter()), contain=contain)
        try:
            await run_update(update, self.pause_mode, self.flush_retries, steps, check_weights=self.check_weights)
            outvoted = [m.id for m in update.members if update.outcome(m) == "mixed"]
            if outvoted:  # this publisher cannot take an engine out (the sync agent quarantines it): fail loudly
                raise WeightSyncError(f"weight sync to version {version}: engines outvoted by the weights check hold other "
                                      f"weights than their peers and keep serving: {', '.join(outvoted)}")
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"weight sync to version {version} failed: {type(exc).__name__}: {exc}") from exc
        t1, t2, t3 = marks["awaiting_broadcast"], marks["loading"], marks["resuming"]
        t4 = time.perf_counter()
        nbytes = weights_nbytes(weights)
        return {
            "trainer/sync_bytes": float(nbytes),
            "trainer/sync_buckets": float(len(buckets)),
            "timing_s/sync_window": t4 - t0,
            "timing_s/sync_pause": t1 - t0,
            "timing_s/sync_group": t2 - t1,
            "timing_s/sync_broadcast": t3 - t2,
            "timing_s/sync_collective": collective[0],
            "timing_s/sync_load": t3 - t2 - collective[0],
            "timing_s/sync_resume": t4 - t3,
            "trainer/sync_gb_per_s": nbytes / 1e9 / max(t3 - t2, 1e-9),
            "trainer/sync_collective_gb_per_s": nbytes / 1e9 / max(collective[0], 1e-9),
        }

    async def current_version(self) -> int | None:
        """The newest version any engine serves (None if none answers)."""
        versions = await asyncio.gather(*(e.weight_version(timeout_s=self.control_timeout_s) for e in self.engines),
                                        return_exceptions=True)
        numbers = [v or 0 for v in versions if not isinstance(v, BaseException)]
        return max(numbers) if numbers else None

    async def close(self) -> None:
        try:
            if self.group is not None:
                await self._drop_group(self._update())
        finally:
            await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)
