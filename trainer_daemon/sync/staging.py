"""Staging a weight version for the sync: its buckets, packed where the collective reads them.

Three ways from "the optimiser step is done" to "bucket ``i`` is in a byte buffer on the weight
group's device" (``sync.staging``):

- ``state_dict`` (the host path): every rank gathers the full state dict into host memory
  (:func:`trainer_daemon.policy.model.full_state_dict`), rank 0 casts it (``engine_weights``) and the
  publish packs each bucket into a reused host buffer while the previous one is on the wire
  (``sync/flat.py``), then moves it to the GPU for NCCL. Measured on one H100 (issue 32): 5.5 s
  for a 1.5B model before the first byte is broadcast. Right for gloo and CPU engines.
- ``buckets`` (:class:`WeightStager`, the device path): at the sync point every rank walks the
  bucket plan; each parameter is gathered to its full tensor where it lives (FSDP2: one
  all-gather per parameter, ``DTensor.full_tensor``; one rank: the parameter itself), and rank
  0 copies it, cast to the engines' dtype, straight into its place in the bucket's byte buffer
  (SGLang's flattened-bucket layout, :mod:`asyncrl.weight_sync.buckets`) on the weight group's
  device: the GPU for NCCL, host memory for gloo. The publish then only broadcasts.
- ``two_buckets`` (:meth:`WeightStager.stream`): the same walk, but rank 0 packs each bucket
  into one of two reused buffers while the publish broadcasts the other
  (:mod:`trainer_daemon.sync.streaming`): memory bounded by two buckets, and the training
  thread waits for the publish until the last bucket is packed.

Consistency with training: :meth:`WeightStager.capture` runs in the training loop between the
optimiser step and the next step, on every rank, and returns only once rank 0's copies are
complete (a stream synchronisation on CUDA: the step's own kernels are already done, since the
step's metrics were read): the buffers hold exactly this version's weights, and the next step
may change the parameters freely. The buffers are reused by the next capture, which comes only
after the publish reading them ended (the daemon waits for it before capturing), and are
replaced by new ones after a failed publish (:meth:`StagedWeights.discard`: an aborted
collective may still read the old ones).

Memory (``buckets``): the buffers are the model's bytes in the engines' dtype on rank 0 (1.5B parameters in
bf16: 3.1 GB of GPU memory, held for the trainer's lifetime), plus one parameter gathered at a
time on every rank. Preparation costs one device copy pass (plus the all-gathers with several
ranks); nothing of it is in the engines' pause window.

The plan puts the smallest tensor first, alone, on every sync (a freshly formed group's first
collective is then a few bytes: ``plan_buckets(first_tiny=True)``); with ``state_dict`` only a
forming publish does that.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from asyncrl.models.checkpoint_layout import CheckpointLayout
from asyncrl.weight_sync import Bucket, byte_layout, dtype_name, plan_buckets
from trainer_daemon.sync.streaming import SLOTS, BucketStream

log = logging.getLogger(__name__)


@dataclass
class StagedWeights:
    """One version's packed buckets (module docstring): ``flats[i]`` is bucket ``i``'s bytes."""

    buckets: list[Bucket]
    flats: list[torch.Tensor]
    timings: dict[str, float] = field(default_factory=dict)
    discarded: bool = False

    @property
    def nbytes(self) -> int:
        return sum(int(f.numel()) for f in self.flats)

    def discard(self) -> None:
        """The publish reading these buffers failed: the next capture writes into new ones."""
        self.discarded = True


def engine_tensors(model: torch.nn.Module, tied: bool) -> list[tuple[str, torch.Tensor]]:
    """``(in-memory name, tensor)`` of what engines load, in state-dict order: every entry of
    the state dict (parameters as FSDP2 leaves them: sharded DTensors with several ranks) but
    ``lm_head.weight`` when the embeddings are tied (as ``engine_weights``). Engines get them
    under their checkpoint names (:func:`engine_layout`)."""
    return [(n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]


def engine_layout(model: torch.nn.Module, tied: bool) -> CheckpointLayout:
    """The checkpoint names engines load :func:`engine_tensors` by (SGLang's ``load_weights``
    takes a checkpoint's names: a MoE model's experts one matrix each, where transformers fuses
    them in memory; a dense model's are its in-memory names). Built once per model."""
    return CheckpointLayout(model, [n for n, _ in engine_tensors(model, tied)])


class WeightStager:
    """The bucket plan of a model's engine weights and rank 0's reused byte buffers.

    ``dtype``: the engines' dtype (floating tensors are cast to it; others keep theirs);
    ``device``: where the buffers live (the weight group's: ``cuda`` for NCCL, ``cpu`` for gloo);
    ``is_sender``: rank 0 (the others only take part in the gathers); ``layout``: the engines'
    names (:func:`engine_layout`; built here when not given). Buckets hold checkpoint names: a
    fused in-memory tensor is gathered once and split into its checkpoint tensors."""

    def __init__(self, model: torch.nn.Module, *, tied: bool, dtype: torch.dtype, bucket_bytes: int,
                 device: torch.device | str, is_sender: bool, layout: CheckpointLayout | None = None) -> None:
        self.tied, self.dtype, self.device, self.is_sender = tied, dtype, torch.device(device), is_sender
        self.layout = layout if layout is not None else engine_layout(model, tied)
        meta = {p.name: torch.empty(p.shape, dtype=self._target(t.dtype), device="meta")
                for n, t in engine_tensors(model, tied) for p in self.layout.pieces[n]}
        self.buckets = plan_buckets(meta, bucket_bytes, first_tiny=True)
        self._offsets = [byte_layout(b.names, [dtype_name(d) for d in b.dtypes], b.shapes)[0] for b in self.buckets]
        self._flats: list[torch.Tensor] | None = None
        self._last: StagedWeights | None = None
        self._slots: list[torch.Tensor] | None = None  # two_buckets: the stream's two reused buffers
        self._last_stream: BucketStream | None = None

    def _target(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if dtype.is_floating_point else dtype

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def _buffers(self) -> list[torch.Tensor]:
        if self._flats is None or (self._last is not None and self._last.discarded):
            self._flats = [torch.empty(b.nbytes, dtype=torch.uint8, device=self.device) for b in self.buckets]
        return self._flats

    @torch.no_grad()
    def _walk(self, model: torch.nn.Module, dest, done=None) -> float:
        """*Collective.* Gather every bucket's tensors in plan order on every rank; where
        ``dest(i)`` gives a byte buffer, copy them, cast, into their places; ``done(i, flat)``
        after each bucket written. Returns the seconds spent gathering (host time)."""
        tensors = dict(engine_tensors(model, self.tied))
        gathered: dict[str, dict[str, torch.Tensor]] = {}  # source -> its checkpoint tensors not yet copied
        gather_s = 0.0
        for i, bucket in enumerate(self.buckets):
            flat = dest(i)
            for name, dtype, shape, off in zip(bucket.names, bucket.dtypes, bucket.shapes, self._offsets[i], strict=True):
                g = time.perf_counter()
                source = self.layout.by_name[name].source
                if source not in gathered:  # the gather is collective; only a writer splits the result
                    t = tensors[source]
                    full = t.full_tensor() if isinstance(t, DTensor) else t
                    gathered[source] = (dict(self.layout.checkpoint_tensors(source, full)) if flat is not None
                                        else {p.name: full for p in self.layout.pieces[source]})
                full = gathered[source].pop(name)
                if not gathered[source]:
                    del gathered[source]
                gather_s += time.perf_counter() - g
                if flat is not None:
                    n = full.numel() * dtype.itemsize
                    flat[off:off + n].view(dtype).view(shape).copy_(full.detach(), non_blocking=self.device.type == "cuda")
            if flat is not None and done is not None:
                done(i, flat)
        return gather_s

    def capture(self, model: torch.nn.Module, write: bool = True) -> StagedWeights | None:
        """*Collective* (every rank, same order). Rank 0 with ``write`` returns the staged
        version; every other call returns None (``write=False``: rank 0 takes part in the
        gathers but leaves the buffers alone, e.g. while a publish still reads them)."""
        t0 = time.perf_counter()
        keep = self.is_sender and write
        flats = self._buffers() if keep else None
        gather_s = self._walk(model, lambda i: flats[i] if flats is not None else None)
        if flats is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not keep:
            return None
        self._last = StagedWeights(list(self.buckets), list(flats),
                                   {"timing_s/sync_stage": time.perf_counter() - t0, "timing_s/sync_stage_gather": gather_s})
        return self._last

    # -- sync.staging = two_buckets (trainer_daemon/sync/streaming.py) ----------------------
    def open_stream(self, wait_s: float) -> BucketStream:
        """Rank 0: a stream of this plan's buckets through two reused slots (new ones after a
        discarded stream), for a publish to consume while :meth:`stream` fills it."""
        largest = max((b.nbytes for b in self.buckets), default=0)
        last = self._last_stream
        if self._slots is None or (last is not None and last.discarded):
            self._slots = [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(SLOTS)]
        self._last_stream = BucketStream(self.buckets, self._slots, wait_s=wait_s, cuda_events=self.device.type == "cuda")
        return self._last_stream

    def stream(self, model: torch.nn.Module, out: BucketStream | None) -> None:
        """*Collective* (every rank, same order, as :meth:`capture`). Rank 0 with ``out`` packs
        each bucket into a free slot of ``out`` and hands it over; returns when the last one is
        packed (the training thread waits for the publish meanwhile: module docstring of
        ``streaming``). Others, and rank 0 without ``out``, only take part in the gathers."""
        t0 = time.perf_counter()
        if out is None:
            self._walk(model, lambda i: None)
            return
        waited = [0.0]

        def slot(i: int) -> torch.Tensor | None:
            w = time.perf_counter()
            flat = out.slot(i)
            waited[0] += time.perf_counter() - w
            return flat

        gather_s = self._walk(model, slot, out.put)
        out.timings.update({"timing_s/sync_stage": time.perf_counter() - t0, "timing_s/sync_stage_gather": gather_s,
                            "timing_s/sync_stage_wait": waited[0]})
