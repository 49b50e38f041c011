"""Receiving weights (gloo broadcast or safetensors on disk) and applying them safely.

Contract:

- An update is *staged*: tensors are received (or read) into fresh buffers, every name,
  shape and value (finite) is checked against the model, and only then copied into the parameters (with
  a dtype cast, e.g. a float32 trainer into a bfloat16 engine). A rejected call leaves
  the model as it was and answers ``success: false``.
- Distributed calls whose body is inconsistent (lengths, dtypes, flattened with mixed
  dtypes, unknown group) are refused *before* the broadcast. Calls with unknown names or
  wrong shapes still receive the broadcast (the sender would otherwise hang until its
  timeout, and the group would fall out of step) and are refused afterwards.
- Consistency: a full update arrives as many bucket calls. The manager remembers which
  parameters changed since the model was last "whole" (every parameter written since the
  previous whole point, or a full disk load). If a call fails while that set is not
  empty, some parameters are new and some old: ``consistent`` turns false with a reason
  (``/model_info`` ``weights_consistent``, ``/health`` 503, ``/generate`` 503) until a
  disk load or distributed writes covering every parameter make it whole again.
- A broadcast that fails or times out marks its group broken: destroy and re-form it.

Not covered: ``update_weights_from_tensor`` (CUDA IPC handles have no CPU meaning),
non-safetensors checkpoints, parameters whose names differ from the Hugging Face ones.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from asyncrl.weight_sync import (
    WeightGroup,
    WeightSyncError,
    init_weight_group,
    parse_dtype,
    receive_bucket,
)
from local_engine.protocol import InitGroupBody, UpdateDistributedBody

log = logging.getLogger(__name__)


class WeightUpdateError(Exception):
    """An update call that failed; ``message`` goes to the client as ``success: false``."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class WeightManager:
    """Model weights as the engine's routes see them: names, version, groups, consistency."""

    def __init__(self, weights: dict[str, torch.Tensor], version: str, timeout_s: float):
        self.params = weights
        self.version = version
        self.timeout_s = timeout_s
        self.groups: dict[str, WeightGroup] = {}
        self.consistent = True
        self.inconsistent_reason: str | None = None
        self._canonical: dict[str, str] = {}
        first_by_ptr: dict[tuple, str] = {}
        for name, t in weights.items():  # tied weights share storage: one canonical name
            key = (t.data_ptr(), tuple(t.shape)) if t.numel() else (name,)
            self._canonical[name] = first_by_ptr.setdefault(key, name)
        self._all = set(first_by_ptr.values())
        self._touched: set[str] = set()

    # -- groups --------------------------------------------------------------------------
    async def init_group(self, body: InitGroupBody) -> str:
        if body.group_name in self.groups:
            raise WeightUpdateError(f"group {body.group_name!r} already exists; destroy it first")
        try:
            group = await asyncio.to_thread(
                init_weight_group, body.master_address, body.master_port, body.world_size, body.rank_offset,
                group_name=body.group_name, backend=body.backend, timeout_s=self.timeout_s,
            )
        except WeightSyncError as exc:
            raise WeightUpdateError(str(exc)) from None
        self.groups[body.group_name] = group
        return f"Succeeded to initialize group {body.group_name!r} as rank {body.rank_offset} of {body.world_size}."

    async def destroy_group(self, name: str) -> str:
        group = self.groups.pop(name, None)
        if group is None:
            raise WeightUpdateError(f"no weight update group named {name!r}")
        await asyncio.to_thread(group.destroy)
        return f"Succeeded to destroy group {name!r}."

    async def close(self) -> None:
        for name in list(self.groups):
            await self.destroy_group(name)

    # -- distributed ---------------------------------------------------------------------
    def plan_receive(self, body: UpdateDistributedBody) -> tuple[WeightGroup, list[torch.dtype]]:
        """Checks that can run before the broadcast; raises WeightUpdateError."""
        group = self.groups.get(body.group_name)
        if group is None:
            raise WeightUpdateError(f"no weight update group named {body.group_name!r}; call /init_weights_update_group first")
        if group.broken:
            raise WeightUpdateError(f"group {body.group_name!r} is broken ({group.broken}); destroy and re-form it")
        try:
            dtypes = [parse_dtype(d) for d in body.dtypes]
        except ValueError as exc:
            raise WeightUpdateError(str(exc)) from None
        if body.load_format == "flattened_bucket" and len(set(dtypes)) > 1:
            raise WeightUpdateError("load_format flattened_bucket needs one dtype per call")
        return group, dtypes

    async def receive(self, group: WeightGroup, body: UpdateDistributedBody, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """Run the receiving side of the bucket's broadcasts (in a thread)."""
        flattened = body.load_format == "flattened_bucket"
        try:
            return await asyncio.to_thread(receive_bucket, group, dtypes, body.shapes, flattened, self.timeout_s)
        except WeightSyncError as exc:
            raise WeightUpdateError(f"broadcast failed, weights unchanged by this call: {exc}") from None

    # -- disk ----------------------------------------------------------------------------
    @staticmethod
    def read_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        root = Path(path)
        if not root.is_dir():
            raise WeightUpdateError(f"model_path {path!r} is not a directory")
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise WeightUpdateError(f"no *.safetensors files in {path!r} (only safetensors checkpoints are supported)")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                tensors.update(load_file(str(f)))
            except Exception as exc:
                raise WeightUpdateError(f"cannot read {f.name}: {exc}") from None
        return tensors

    # -- staging checks and apply --------------------------------------------------------
    def validate(self, names: list[str], tensors: list[torch.Tensor], *, full: bool = False) -> None:
        """Raise WeightUpdateError unless every name is known with the right shape (and,
        with ``full``, every parameter is covered)."""
        unknown = [n for n in names if n not in self.params]
        if unknown:
            raise WeightUpdateError(f"unknown parameter names: {', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
        bad = [
            f"{n}: got {list(t.shape)}, model has {list(self.params[n].shape)}"
            for n, t in zip(names, tensors, strict=True)
            if tuple(t.shape) != tuple(self.params[n].shape)
        ]
        if bad:
            raise WeightUpdateError("shape mismatch: " + "; ".join(bad[:8]))
        if not all(t.is_floating_point() for t in tensors):
            raise WeightUpdateError("weights must be floating point tensors")
        nonfinite = [n for n, t in zip(names, tensors, strict=True) if not bool(torch.isfinite(t).all())]
        if nonfinite:
            raise WeightUpdateError(f"non-finite values (NaN/inf) in: {', '.join(nonfinite[:8])}")
        if full:
            missing = self._all - {self._canonical[n] for n in names}
            if missing:
                raise WeightUpdateError(f"checkpoint lacks parameters: {', '.join(sorted(missing)[:8])}")

    @torch.no_grad()
    def apply(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Copy staged tensors into the parameters (call with the scheduler held)."""
        for n, t in zip(names, tensors, strict=True):
            self.params[n].copy_(t)
        self._touched |= {self._canonical[n] for n in names}
        if self._touched >= self._all:
            self._touched.clear()
            if not self.consistent:
                log.info("every parameter rewritten since the failed update: weights consistent again")
            self.consistent, self.inconsistent_reason = True, None

    def mark_whole(self) -> None:
        """After a full load: nothing is half-updated."""
        self._touched.clear()
        self.consistent, self.inconsistent_reason = True, None

    def record_failure(self, reason: str) -> None:
        """A failed call: the weights are mixed if an update was under way."""
        if self._touched:
            self.consistent = False
            self.inconsistent_reason = (
                f"{reason} after {len(self._touched)} of {len(self._all)} parameters had been updated; "
                "reload with /update_weights_from_disk or push every parameter again"
            )
            log.error("weights inconsistent: %s", self.inconsistent_reason)
