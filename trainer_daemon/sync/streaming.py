"""Buckets handed from the training thread to the publish through two reused buffers
(``sync.staging = two_buckets``): the sync's device path with GPU memory bounded by two buckets.

The *producer* is :meth:`trainer_daemon.sync.staging.WeightStager.stream`, on every rank's
training thread right after the optimiser step: for each bucket in plan order every rank
gathers its parameters (FSDP2 all-gathers) and rank 0 takes a free slot (:meth:`BucketStream.slot`,
waiting while both slots hold buckets the publish has not sent yet), copies the bucket's
tensors, cast, into it on the current CUDA stream, records a CUDA event after the copies and
hands the slot over (:meth:`BucketStream.put`). The *consumer* is the publish on the I/O loop
(:func:`trainer_daemon.sync.flat.send_buckets`): :meth:`BucketStream.get` waits for bucket ``i``'s
hand-off and for its event (the copies done on the GPU), the publish broadcasts it on its side
stream, and :meth:`BucketStream.release` frees the slot once that broadcast is complete. So
packing bucket ``i + 1`` (default stream) runs while bucket ``i`` is on the wire (side stream):
the pause window holds one bucket's packing (the first) beyond the broadcasts.

Consistency: the parameters cannot change while the producer runs (it *is* the training
thread: the next step starts when the last bucket is packed), and the copies are queued on the
default stream before the next step's kernels. The price: the training thread waits for the
publish to send all but the last two buckets, i.e. for the engines' pause and most of the
broadcast (``timing_s/sync_stage_wait``). Use it where the model's bytes in ``model.dtype``
(what ``buckets`` keeps on rank 0's GPU for the trainer's lifetime) do not fit;
``sync.staging = auto`` picks it then (:func:`trainer_daemon.sync.staging_mode`).

Memory: two buffers of the largest bucket (at most ``2 × sync.bucket_bytes``, or one tensor's
bytes if a tensor is bigger) on rank 0's weight-group device, plus one gathered parameter at a
time on every rank.

Failure: whatever ends the publish closes the stream (:meth:`close`; the
:class:`~trainer_daemon.sync.base.SyncController` does it when the publish's future is done,
``discard`` when it failed). A producer waiting for a slot then stops writing but keeps
gathering (the other ranks' all-gathers expect rank 0), and the stager takes new buffers for
the next sync (an aborted collective may still read the old ones). A producer that waits longer
than ``wait_s`` for a slot closes the stream itself; the publish then fails on :meth:`get`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import torch

from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.weight_sync import Bucket

SLOTS = 2


class BucketStream:
    """One version's buckets on their way from the training thread to the publish (module
    docstring). ``slots``: the reused byte buffers, each at least the largest bucket."""

    def __init__(self, buckets: Sequence[Bucket], slots: Sequence[torch.Tensor], *, wait_s: float, cuda_events: bool) -> None:
        if len(slots) != SLOTS or any(int(s.numel()) < max((b.nbytes for b in buckets), default=0) for s in slots):
            raise ValueError(f"a bucket stream needs {SLOTS} slots of at least the largest bucket's bytes")
        self.buckets = list(buckets)
        self.wait_s = wait_s
        self.timings: dict[str, float] = {}
        self.discarded = False
        self._slots = list(slots)
        self._cuda_events = cuda_events
        self._cond = threading.Condition()
        self._ready: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._released = 0  # buckets 0 .. released-1 are sent: their slots may be written again
        self._closed: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    # -- producer (the training thread) -----------------------------------------------------
    def slot(self, i: int) -> torch.Tensor | None:
        """Bucket ``i``'s bytes to write (a view of slot ``i % 2``), once the bucket that held it
        (``i - 2``) is sent; None when the stream is closed (write nothing more). Waiting longer
        than ``wait_s`` closes it."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed is not None or self._released >= i - 1, self.wait_s):
                self._close(f"bucket {i} waited {self.wait_s:g} s for a free buffer: the publish did not take bucket {i - 2}", True)
            if self._closed is not None:
                return None
        return self._slots[i % SLOTS][: self.buckets[i].nbytes]

    def put(self, i: int, flat: torch.Tensor) -> None:
        """Bucket ``i`` is packed in ``flat`` (copies queued on the current stream): hand it over."""
        event = None
        if self._cuda_events:
            event = torch.cuda.Event()
            event.record()
        with self._cond:
            self._ready[i] = (flat, event)
            self._cond.notify_all()

    # -- consumer (the publish) -------------------------------------------------------------
    def _wait_ready(self, i: int) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: i in self._ready or self._closed is not None, self.wait_s):
                self._close(f"bucket {i} was not packed within {self.wait_s:g} s", True)
            if i not in self._ready:
                raise WeightSyncError(f"bucket {i} of the weight stream never came: {self._closed}")
            flat, event = self._ready[i]
        if event is not None:
            event.synchronize()  # this bucket's copies are done (not the next ones')
        return flat

    async def get(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s packed bytes, once the producer handed them over and they are written."""
        t0 = time.perf_counter()
        flat = await asyncio.to_thread(self._wait_ready, i)
        self.timings["timing_s/sync_stream_wait"] = self.timings.get("timing_s/sync_stream_wait", 0.0) + time.perf_counter() - t0
        return flat

    def release(self, i: int) -> None:
        """Bucket ``i``'s broadcast is complete: its slot may be written again."""
        with self._cond:
            self._ready.pop(i, None)
            self._released = max(self._released, i + 1)
            self._cond.notify_all()

    # -- either side ------------------------------------------------------------------------
    def _close(self, why: str, discard: bool) -> None:
        if self._closed is None:
            self._closed = why
        self.discarded = self.discarded or discard
        self._cond.notify_all()

    def close(self, why: str = "the publish ended", *, discard: bool = False) -> None:
        """No more buckets: a waiting producer stops writing. ``discard``: the publish failed,
        and an aborted collective may still read the slots (the stager takes new ones)."""
        with self._cond:
            self._close(why, discard)

    def discard(self) -> None:
        """The publish reading these buffers failed (as :meth:`StagedWeights.discard`)."""
        self.close("the publish failed", discard=True)
