"""Sharded checkpoints with ``torch.distributed.checkpoint``, complete only once marked.

Layout under ``<run dir>/checkpoints/``::

    step-00000012/                  a complete checkpoint (renamed from step-00000012.incomplete/)
        dcp/                        model + optimiser shards of every rank (DCP, ``.metadata`` last)
        rng/rank-00000.pt           each rank's torch RNG state (tensors only; weights_only load)
        hf/                         optional Hugging Face export (``checkpoint.export_hf``)
        trainer_state.json          step, weight version, LR schedule, stream cursor + resolved set, counters
        COMPLETE                    the marker, written last
    ledger/step-00000012.json       training-ledger segment (``trainer_daemon.state.ledger``)

Protocol: every rank writes into ``step-N.incomplete/``; when all ranks have finished (the DCP
save's final gather, then the coordinator's ``.metadata``), rank 0 writes the ledger segment,
``trainer_state.json`` and ``COMPLETE`` (each fsynced) and renames the directory. A crash at any
moment leaves either a complete ``step-N/`` or garbage that :meth:`CheckpointManager.clean`
deletes. :meth:`latest` only accepts ``step-N/`` holding ``COMPLETE``. The newest
``keep_last`` complete checkpoints are kept.

``async_save``: DCP stages the state to host memory before ``async_save`` returns (measured: a
parameter change right after it does not reach the file), then writes in the background through
a dedicated gloo group. At most one save is in flight: the next save, and shutdown, wait for the
previous one first. Rank 0 finalises (marker, rename) as soon as its future is done.

Multi-node: the run directory must be a shared filesystem (DCP's file writer needs one anyway).
Not covered: object stores, cross-version DCP compatibility (PyTorch promises none).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from asyncrl import failpoints
from asyncrl.files import atomic_write
from trainer_daemon.policy.distributed import DistContext
from trainer_daemon.state.ledger import write_segment

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
INCOMPLETE = ".incomplete"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class ModelOptimState(Stateful):
    """Model and optimiser as DCP sees them (sharded ``get_state_dict``/``set_state_dict``)."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def _adapters_only(self) -> bool:
        """With LoRA adapters only the trainable parameters are saved and loaded: the frozen
        base weights come from ``model.path`` at every start, as they did at the first."""
        from trainer_daemon.policy.lora import has_adapters

        return has_adapters(n for n, _ in self.model.named_parameters())

    def state_dict(self) -> dict[str, Any]:
        partial = self._adapters_only()
        msd, osd = get_state_dict(self.model, self.optimizer, options=StateDictOptions(ignore_frozen_params=partial))
        if partial:  # a tied output layer is the frozen embedding under a second name: not saved either
            trainable = {n for n, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad}
            msd = {k: v for k, v in msd.items() if k in trainable}
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """With adapters the base weights are absent by design (not strict); an adapter the
        checkpoint lacks fails DCP's load plan first ("Missing key in checkpoint state_dict")."""
        partial = self._adapters_only()
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(ignore_frozen_params=partial, strict=not partial))


class CheckpointWriter(FileSystemWriter):
    """DCP's file writer with failpoint ``checkpoint.write`` before the shards are written (with
    ``async_save`` this runs in the background thread, so a fault test can kill the trainer while
    the save's future is pending)."""

    def write_data(self, plan, planner):
        failpoints.hold("checkpoint.write")
        return super().write_data(plan, planner)


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj))


def read_state(path: Path) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint directory."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, dir)`` of complete checkpoints, oldest first."""
    out = []
    if Path(root).is_dir():
        for p in Path(root).iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / MARKER).is_file():
                out.append((int(m.group(1)), p))
    return sorted(out)


@dataclass
class _InFlight:
    step: int
    future: Future | None
    tmp: Path
    trainer_state: dict[str, Any] | None
    segment: dict[str, Any] | None
    label: Callable[[dict[str, Any]], dict[str, Any]] | None = None


class CheckpointManager:
    """Save / finalise / load / prune (module docstring). Methods marked *collective* must be
    called on every rank in the same order."""

    def __init__(self, root: Path, ctx: DistContext, keep_last: int, async_save: bool) -> None:
        self.root = Path(root)
        self.ctx = ctx
        self.keep_last = keep_last
        self.async_save = async_save
        self._inflight: _InFlight | None = None
        self._owed_barrier = False  # identical on every rank: a save started since the last wait()

    # -- discovery (rank 0) ----------------------------------------------------------------
    def latest(self) -> Path | None:
        found = complete_checkpoints(self.root)
        return found[-1][1] if found else None

    def clean(self) -> None:
        """Delete leftovers of interrupted saves (rank 0, before anything else runs)."""
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if p.name.endswith(INCOMPLETE) or (_STEP_DIR.match(p.name) and not (p / MARKER).is_file()):
                log.warning("removing incomplete checkpoint %s", p)
                shutil.rmtree(p, ignore_errors=True)

    # -- save ------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any] | None, segment: dict[str, Any] | None,
             export: Callable[[Path], None] | None = None,
             label: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        """*Collective.* Start checkpoint ``step`` (``trainer_state``/``segment``/``export``/``label``: rank 0 only).

        ``export(dir)`` runs on rank 0 after every rank has called ``save`` (it may itself be
        preceded by a collective gather done by the caller). ``label(trainer_state)`` runs on
        rank 0 when the checkpoint is finalised and returns the state to write: what is only
        known later (the version the weights were published as) is filled in then."""
        self.wait()
        tmp = self.root / f"step-{step:08d}{INCOMPLETE}"
        if self.ctx.is_rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        self.ctx.barrier()
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and self.ctx.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.ctx.device)
        torch.save(rng, tmp / "rng" / f"rank-{self.ctx.rank:05d}.pt")
        if export is not None and self.ctx.is_rank0:
            export(tmp / "hf")
        state = {"app": ModelOptimState(model, optimizer)}
        self._owed_barrier = True
        if self.async_save:
            fut = dcp.async_save(state, storage_writer=CheckpointWriter(tmp / "dcp"), process_group=self.ctx.checkpoint_group())
            self._inflight = _InFlight(step, fut, tmp, trainer_state, segment, label)
        else:
            dcp.save(state, storage_writer=CheckpointWriter(tmp / "dcp"))
            self._inflight = _InFlight(step, None, tmp, trainer_state, segment, label)
            self.wait()

    def amend(self, step: int, consumption: dict[str, Any], segment: dict[str, Any]) -> None:
        """Rank 0: record in complete checkpoint ``step`` what was resolved after it was taken (the
        run's end: groups dropped between steps; issue 65). The weights are the checkpoint's, so
        only the ledger segment and the consumption state change, each replaced atomically,
        the segment first: a crash between the two leaves a cursor that the segment covers (the
        drops are read and dropped again at a resume), never drops the segment lacks. Call it
        after :meth:`wait` (no save in flight)."""
        final = step_dir(self.root, step)
        state = json.loads((final / STATE_FILE).read_text())
        write_segment(self.root, segment)
        atomic_write(final / STATE_FILE, json.dumps(state | {"consumption": consumption}))
        log.info("checkpoint %s amended with what was resolved after it", final)

    def poll(self) -> int | None:
        """Rank 0, any time: finalise the in-flight async save if its writes are done; returns
        the finalised step. (The other ranks catch up in the next :meth:`wait`.)"""
        f = self._inflight
        if f is None or f.future is None or not self.ctx.is_rank0 or not f.future.done():
            return None
        f.future.result()
        return self._finalize()

    def wait(self) -> int | None:
        """*Collective.* Wait for the in-flight save and finalise it; returns its step (rank 0)."""
        if not self._owed_barrier:
            return None
        f = self._inflight
        if f is not None and f.future is not None:
            f.future.result()
        self.ctx.barrier()
        self._owed_barrier = False
        return self._finalize() if self.ctx.is_rank0 else self._forget()

    def _forget(self) -> int | None:
        f, self._inflight = self._inflight, None
        return None if f is None else f.step

    def _finalize(self) -> int | None:
        f = self._inflight
        if f is None:
            return None
        if not self.ctx.is_rank0:
            return self._forget()
        if f.segment is not None:
            write_segment(self.root, f.segment)
        trainer_state = f.trainer_state or {}
        if f.label is not None:
            trainer_state = f.label(trainer_state)
        _write_json(f.tmp / STATE_FILE, trainer_state)
        _write_json(f.tmp / MARKER, {"step": f.step, "time": time.time(), "world_size": self.ctx.world_size})
        final = step_dir(self.root, f.step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(f.tmp, final)
        self._forget()
        log.info("checkpoint %s complete", final)
        self._prune()
        return f.step

    def _prune(self) -> None:
        found = complete_checkpoints(self.root)
        for _, p in found[: max(0, len(found) - self.keep_last)]:
            shutil.rmtree(p, ignore_errors=True)

    def oldest_kept_cursor(self) -> int:
        """Stream cursor of the oldest kept complete checkpoint (purge up to it: any kept
        checkpoint can still be resumed exactly)."""
        found = complete_checkpoints(self.root)
        if not found:
            return 0
        return int(read_state(found[0][1]).get("consumption", {}).get("cursor", 0))

    # -- load ------------------------------------------------------------------------------
    def load(self, path: Path, model, optimizer) -> dict[str, Any]:
        """*Collective.* Restore model, optimiser and this rank's RNG from ``path``; returns its trainer state."""
        dcp.load({"app": ModelOptimState(model, optimizer)}, checkpoint_id=str(Path(path) / "dcp"))
        rng_file = Path(path) / "rng" / f"rank-{self.ctx.rank:05d}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.ctx.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.ctx.device)
        else:
            log.warning("no RNG state for rank %d in %s (world size changed?)", self.ctx.rank, path)
        return read_state(path)
