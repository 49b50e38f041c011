"""Per-row LoRA compute: each row of a batch runs its own adapter (or none) on one base model.

:class:`LoraLayers` puts a forward hook on every linear module of the model whose name the
engine serves (``--lora-target-modules``, grouped as SGLang groups them:
:mod:`asyncrl.lora_targets`). Inside ``with layers.rows(adapters):`` (one entry per batch row,
an :class:`AdapterWeights` or None) each hooked module's output gets, for the rows of each
adapter, ``scaling * (x @ A.T) @ B.T`` — peft's unmerged LoRA forward (``LoraLayer.forward``
with dropout off), which equals serving the merged weight ``W + scaling * B @ A`` up to
rounding (``tests/local_engine/test_lora_engine.py`` checks both against peft). Rows of
different adapters never mix: a row's numbers do not depend on its neighbours'.

Why hooks and not peft's own layers: peft's injection renames every adapted weight
(``q_proj.weight`` becomes ``q_proj.base_layer.weight``), which would break the base weight
updates by Hugging Face names that the engine also serves; the hooks leave the module tree
as it is. Adapters are kept in the model's dtype on its device.

Not covered: adapters on embeddings or the output layer, DoRA, rsLoRA, biases (refused when
loaded, :mod:`local_engine.lora`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from asyncrl.lora_targets import ALL, LINEAR_LEAVES, normalized_targets


@dataclass(frozen=True)
class AdapterWeights:
    """One loaded adapter's tensors: module name → (A ``[rank, in]``, B ``[out, rank]``)."""

    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float


class LoraLayers:
    """The hooks of the module docstring on ``model``'s served linear modules."""

    def __init__(self, model: torch.nn.Module, target_modules: Sequence[str]) -> None:
        served = normalized_targets(list(target_modules))
        self.modules: dict[str, torch.nn.Linear] = {}
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if not isinstance(module, torch.nn.Linear) or leaf not in LINEAR_LEAVES:
                continue
            if ALL in served or normalized_targets([leaf]) <= served:
                self.modules[name] = module
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self._rows: Sequence[AdapterWeights | None] | None = None
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in self.modules.items()]

    def shape(self, module: str) -> tuple[int, int] | None:
        """``(in, out)`` features of a served module; None when it is not served."""
        m = self.modules.get(module)
        return None if m is None else (m.in_features, m.out_features)

    def shapes(self) -> list[tuple[int, int]]:
        """``(in, out)`` features of every served module."""
        return [(m.in_features, m.out_features) for m in self.modules.values()]

    def weights(self, modules: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> AdapterWeights:
        """Tensors in the model's dtype and on its device (shapes checked by the caller)."""
        return AdapterWeights({name: (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
                               for name, (a, b) in modules.items()}, scaling)

    @contextmanager
    def rows(self, adapters: Sequence[AdapterWeights | None]) -> Iterator[None]:
        """Apply ``adapters[i]`` to batch row ``i`` for the forward passes inside."""
        self._rows = adapters if any(a is not None for a in adapters) else None
        try:
            yield
        finally:
            self._rows = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module, args, output):
            rows = self._rows
            if rows is None:
                return None
            x = args[0]
            groups: dict[int, tuple[AdapterWeights, list[int]]] = {}
            for i, adapter in enumerate(rows):
                if adapter is not None and name in adapter.modules:
                    groups.setdefault(id(adapter), (adapter, []))[1].append(i)
            for adapter, idx in groups.values():
                a, b = adapter.modules[name]
                index = torch.tensor(idx, dtype=torch.long, device=x.device)
                delta = (x.index_select(0, index) @ a.T) @ b.T
                output.index_add_(0, index, delta * adapter.scaling)
            return output

        return hook
