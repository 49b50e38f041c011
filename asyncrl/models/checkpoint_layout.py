"""The checkpoint names of a model's weights, against the names it has in memory (issue 53).

transformers 5 loads some checkpoints into another layout than they are stored in: a
mixture-of-experts model's experts are fused (Qwen2-/Qwen3-MoE keep ``experts.gate_up_proj``
``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]`` in memory, where the checkpoint, and
SGLang's ``load_weights``, name each expert's matrices ``experts.{e}.gate_proj.weight`` ...).
``save_pretrained`` converts back with the model's own conversion mapping
(``transformers.core_model_loading.revert_weight_conversion``). A weight sync to SGLang must
send the checkpoint's names too.

:class:`CheckpointLayout` derives the correspondence from that same reverse conversion, applied
to *index tensors* (``arange`` over each in-memory tensor, in its shape): every checkpoint
tensor it yields holds the flat indices of the in-memory elements it is made of. So for any
conversion that only moves elements (splits, chunks, unbinds, transposes, concatenations: the
expert layouts), a checkpoint tensor is ``memory.view(-1)[index]`` and writing it back is
``memory.view(-1)[index] = value``. Names without a conversion map to themselves (a dense
model's layout is the identity: :attr:`identity`).

Limits: the index tensors take 8 bytes per element of every converted tensor (fine for the
CPU models local_engine serves; a trainer converting a large model's values should revert the
values themselves, parameter by parameter); conversions that compute (dequantise, permute for
RoPE with arithmetic) are not element moves and are not supported. Not wired into the weight
sync yet (issue 53: the trainer still sends the in-memory names).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor: part of in-memory tensor ``source`` at flat ``index`` (None: all of it)."""

    name: str
    source: str
    shape: tuple[int, ...]
    index: torch.Tensor | None = None


class CheckpointLayout:
    """Checkpoint names ↔ in-memory tensors of one model (module docstring)."""

    def __init__(self, model: torch.nn.Module, names: list[str] | None = None) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        state = model.state_dict()
        self.pieces: dict[str, list[Piece]] = {}
        for source in names if names is not None else list(state):
            t = state[source]
            index = torch.arange(t.numel(), dtype=torch.long).view(tuple(t.shape))
            reverted = revert_weight_conversion(model, {source: index})
            if list(reverted) == [source]:
                self.pieces[source] = [Piece(source, source, tuple(t.shape))]
                continue
            self.pieces[source] = [Piece(name, source, tuple(ix.shape), ix.reshape(-1).clone()) for name, ix in reverted.items()]
        self.by_name = {p.name: p for ps in self.pieces.values() for p in ps}

    @property
    def identity(self) -> bool:
        """True when every checkpoint name is an in-memory name (no conversion)."""
        return all(p.index is None for p in self.by_name.values())

    def checkpoint_tensors(self, source: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint tensors made of in-memory tensor ``source`` (``full``: its whole value)."""
        flat = full.reshape(-1)
        return [(p.name, full if p.index is None else flat[p.index.to(full.device)].view(p.shape)) for p in self.pieces[source]]

    def write(self, memory: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
        """Write checkpoint tensor ``name`` into the in-memory tensors ``memory`` (in place)."""
        p = self.by_name[name]
        dest = memory[p.source]
        with torch.no_grad():
            if p.index is None:
                dest.copy_(value)
            else:
                dest.view(-1)[p.index.to(dest.device)] = value.reshape(-1).to(dest.dtype)
