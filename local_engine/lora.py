"""LoRA adapters the engine serves: SGLang's dynamic adapter registry, as strict as SGLang.

What SGLang 0.5.15-0.5.23 does, read from its wheels (``managers/tokenizer_control_mixin.py``,
``lora/lora_manager.py``, ``lora/lora_registry.py``, ``lora/mem_pool.py``), and what
:class:`AdapterStore` does the same way:

- LoRA is on with ``--enable-lora`` (or ``--lora-paths``); it then needs ``--lora-paths`` or
  both ``--max-lora-rank`` and ``--lora-target-modules`` (checked by :mod:`local_engine.settings`). Off,
  every adapter route answers "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
  and a ``/generate`` naming an adapter is refused.
- A load is refused, one adapter at a time (a lock), for: a name already loaded ("Failed to
  load LoRA adapter X because it is already loaded"), a name whose unload has not finished, a
  DoRA adapter, a rank over ``--max-lora-rank`` or targets outside ``--lora-target-modules``
  ("... is incompatible with the current LoRA memory pool configuration ..."), and here also a
  weight that does not fit the module it names (SGLang fails later, on the copy). Every answer
  is ``LoRAUpdateOutput``: ``success``, ``error_message``, ``loaded_adapters`` (name → path,
  ``__tensor__`` for adapters sent as tensors), and its base's ``rid`` and ``http_worker_ipc``
  (null over HTTP).
- An unload takes the name out at once (new requests for it fail), then waits until no request
  uses the adapter, then frees it; an unknown name: "LoRA with name X does not exist ...".
- ``--max-loaded-loras``: a load that goes over it unloads the least recently used unpinned
  adapter (waiting for its requests). A request naming an adapter that was loaded from a path
  and later unloaded or evicted reloads it implicitly; one loaded from tensors cannot be.
- A request acquires its adapter after the pause gate and releases it when it ends.

Not modelled: ``--max-loras-per-batch`` (a batch here may hold any number of adapters),
adapters that add tokens, pinned-slot starvation checks, embedding/output-layer adapters.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncrl import failpoints
from asyncrl.lora_targets import covers, normalized_targets
from local_engine.lora_compute import AdapterWeights, LoraLayers

TENSOR_PATH = "__tensor__"
"""``lora_path`` SGLang records for an adapter loaded from tensors."""
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
PREFIX = "base_model.model."
SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1}


class LoraError(ValueError):
    """A refused adapter operation; the message is SGLang's where SGLang has one."""


MAX_LORA_ALPHA = 1e6
"""Largest ``lora_alpha`` in size accepted (peft's are single or double digits; 1e308 made every
output infinite: issue 48)."""


def sha256_of(t: torch.Tensor) -> str:
    """SGLang's checksum of one adapter tensor (``tp_worker.load_lora_adapter_from_tensors``)."""
    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def lora_path_spec(spec: str) -> tuple[str, str]:
    """One ``--lora-paths`` entry as (name, path): ``NAME=PATH``, or ``PATH`` named by itself."""
    name, sep, path = spec.partition("=")
    return (name, path) if sep else (spec, spec)


def read_adapter_config(path: str) -> dict:
    """``adapter_config.json`` of a peft adapter directory. No hub: a path that is not a
    directory fails."""
    root = Path(path)
    if not root.is_dir():
        raise LoraError(f"LoRA path {path!r} is not a directory this engine can read (local_engine has no model hub)")
    return json.loads((root / "adapter_config.json").read_text())


def read_adapter_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """:func:`read_adapter_config` and the adapter's tensors (safetensors, or
    ``adapter_model.bin`` read with ``weights_only``)."""
    config = read_adapter_config(path)
    root = Path(path)
    if (root / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        return config, load_file(str(root / "adapter_model.safetensors"))
    return config, torch.load(root / "adapter_model.bin", map_location="cpu", weights_only=True)


@dataclass(eq=False)
class Adapter:
    """One registered adapter and the requests using it."""

    name: str
    path: str
    pinned: bool
    rank: int
    weights: AdapterWeights
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    users: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


class AdapterStore:
    """The registry of the module docstring over :class:`LoraLayers` (None: LoRA off)."""

    def __init__(self, layers: LoraLayers | None, max_rank: int | None, targets: list[str] | None,
                 max_loaded: int | None, incomplete_unloads: bool = True) -> None:
        self.layers = layers
        self.max_rank = max_rank or 0
        self.targets = normalized_targets(targets) if targets else set()
        self.target_modules = sorted(targets) if targets else None
        """``--lora-target-modules`` as given (or inferred from ``--lora-paths``), for /server_info."""
        self.max_loaded = max_loaded
        self.registry: OrderedDict[str, Adapter] = OrderedDict()  # least recently used first
        self.seen: dict[str, tuple[str, bool]] = {}  # every name ever loaded → (path, pinned): SGLang's lora_ref_cache
        self.pending_unloads: set[str] = set()
        self.incomplete: set[str] = set()
        """Names whose load failed on some rank after another loaded it (SGLang 0.5.21+: refused
        until unloaded; injected by the ``local_engine.lora_partial_load`` failpoint)."""
        self.incomplete_unloads = incomplete_unloads
        self.lock = asyncio.Lock()

    @property
    def enabled(self) -> bool:
        return self.layers is not None

    def max_adapter_bytes(self) -> int:
        """The most bytes an adapter this engine could serve holds: ``--max-lora-rank`` ×
        (fan-in + fan-out) of every served module, at 8 bytes a value (float64, the widest dtype
        admitted). 0 with LoRA off."""
        if self.layers is None:
            return 0
        return sum(self.max_rank * (fan_in + fan_out) * 8 for fan_in, fan_out in self.layers.shapes())

    def loaded_adapters(self) -> dict[str, str]:
        return {a.name: a.path for a in self.registry.values()}

    def output(self, ok: bool, message: str = "", listed: bool = True) -> dict:
        """``LoRAUpdateOutput`` as SGLang renders it."""
        return {"rid": None, "http_worker_ipc": None, "success": ok, "error_message": message,
                "loaded_adapters": self.loaded_adapters() if listed else None}

    # -- load / unload -------------------------------------------------------------------
    async def load(self, name: str, path: str, pinned: bool, config: Mapping | None = None,
                   tensors: Mapping[str, torch.Tensor] | None = None) -> dict:
        """Load from ``path`` (a peft directory), or from ``config`` + ``tensors`` (``path``
        then :data:`TENSOR_PATH`); the ``LoRAUpdateOutput`` to answer."""
        if not self.enabled:
            return self.output(False, NOT_ENABLED, listed=False)
        async with self.lock:
            if name in self.pending_unloads or name in self.incomplete:
                return self.output(False, f"LoRA adapter '{name}' has an incomplete unload. "
                                          "Retry the unload before loading it again.", listed=False)
            try:
                if tensors is None:
                    config, tensors = await asyncio.to_thread(read_adapter_dir, path)
                adapter = self._build(name, path, pinned, dict(config or {}), tensors)
            except (LoraError, OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
                return self.output(False, str(exc))
            if self.incomplete_unloads and failpoints.fires("local_engine.lora_partial_load"):
                self.incomplete.add(name)  # one rank loaded it, another failed: neither registered nor gone
                return self.output(False, f"Failed to load LoRA adapter {name} on every rank (injected: "
                                          "local_engine.lora_partial_load)")
            self.registry[name] = adapter
            self.seen[name] = (path, pinned)
            if self.max_loaded is not None and len(self.registry) > self.max_loaded:
                lru = next((n for n, a in self.registry.items() if not a.pinned), None)
                if lru is not None:
                    await self._unload_locked(lru)
            return self.output(True)

    async def unload(self, name: str) -> dict:
        if not self.enabled:
            return self.output(False, NOT_ENABLED, listed=False)
        async with self.lock:
            try:
                await self._unload_locked(name)
            except LoraError as exc:
                return self.output(False, str(exc), listed=False)
            return self.output(True)

    async def _unload_locked(self, name: str) -> None:
        adapter = self.registry.pop(name, None)
        if adapter is None and name in self.incomplete:  # the unload SGLang's message asks for
            self.incomplete.discard(name)
            return
        if adapter is None:
            raise LoraError(f"LoRA with name {name} does not exist. Loaded LoRAs: {self.registry.keys()}")
        self.pending_unloads.add(name)
        try:
            await adapter.idle.wait()  # the requests using it finish first
        finally:
            self.pending_unloads.discard(name)

    def _build(self, name: str, path: str, pinned: bool, config: dict, tensors: Mapping[str, torch.Tensor]) -> Adapter:
        """Validate in SGLang's order (module docstring), then the weights against the model."""
        if config.get("use_dora"):
            raise LoraError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
        if name in self.registry:
            raise LoraError(f"Failed to load LoRA adapter {name} because it is already loaded")
        rank, alpha = config["r"], config["lora_alpha"]
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1 or not isinstance(alpha, (int, float)):
            raise LoraError(f"adapter {name}: config needs an integer r >= 1 and a number lora_alpha "
                            f"(got r={rank!r}, lora_alpha={alpha!r})")
        if not math.isfinite(alpha) or not 0 < abs(alpha) <= MAX_LORA_ALPHA:
            raise LoraError(f"adapter {name}: lora_alpha must be finite, non-zero and at most {MAX_LORA_ALPHA:g} "
                            f"in size (got {alpha!r})")
        targets = config["target_modules"]
        if not (isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
            raise LoraError(f"adapter {name}: target_modules must be a string or a list of names")
        if rank > self.max_rank or not covers(self.targets, normalized_targets(config["target_modules"])):
            raise LoraError(
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool configuration. "
                "Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` and that the "
                "target modules are included in `--lora-target-modules`.")
        pairs: dict[str, list[torch.Tensor | None]] = {}
        for key, t in tensors.items():
            suffix = next((s for s in SUFFIXES if key.endswith(s)), None)
            if not key.startswith(PREFIX) or suffix is None:
                raise LoraError(f"adapter tensor {key!r} is not a LoRA A/B weight in peft's saved format "
                                f"({PREFIX}<module>.lora_A.weight)")
            pairs.setdefault(key[len(PREFIX):-len(suffix)], [None, None])[SUFFIXES[suffix]] = t
        modules = {}
        for module, (a, b) in pairs.items():
            shape = self.layers.shape(module)
            if shape is None:
                raise LoraError(f"adapter {name} has weights for {module}, which this engine does not adapt "
                                f"(--lora-target-modules {' '.join(sorted(self.targets))})")
            if a is None or b is None:
                raise LoraError(f"adapter {name}: {module} needs both lora_A and lora_B")
            fan_in, fan_out = shape
            if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
                raise LoraError(f"adapter {name}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                                f"rank {rank} on this model needs {(rank, fan_in)} and {(fan_out, rank)}")
            modules[module] = (a, b)
        return Adapter(name=name, path=path, pinned=pinned, rank=rank,
                       weights=self.layers.weights(modules, float(alpha) / rank))

    # -- requests ------------------------------------------------------------------------
    async def acquire(self, name: str) -> Adapter:
        """The adapter a request names, counted as in use (SGLang's ``_resolve_lora_path``):
        raises LoraError (the request is refused with 400)."""
        if name not in self.registry:
            if name not in self.seen:
                raise LoraError(f"Got LoRA adapter that has never been loaded: {name}\n"
                                f"All loaded adapters: {self.seen.keys()}.")
            path, pinned = self.seen[name]
            if path == TENSOR_PATH:
                raise LoraError(f"Failed to implicitly load LoRA adapter {name}: it was loaded from tensors "
                                "and has been unloaded; load it again")
            result = await self.load(name, path, pinned)
            if not result["success"] and "already loaded" not in result["error_message"]:
                raise LoraError(f"Failed to implicitly load LoRA adapter {name}: {result['error_message']}")
        adapter = self.registry.get(name)
        if adapter is None:  # unloaded again meanwhile
            raise LoraError(f"The following requested LoRA adapters are not loaded: {name}\n"
                            f"Loaded adapters: {self.registry.keys()}.")
        self.registry.move_to_end(name)
        adapter.users += 1
        adapter.idle.clear()
        return adapter

    @staticmethod
    def release(adapter: Adapter) -> None:
        adapter.users -= 1
        if adapter.users == 0:
            adapter.idle.set()
