"""The checkpoint names of a model's weights, against the names it has in memory (issue 53).

transformers 5 loads some checkpoints into another layout than they are stored in: a
mixture-of-experts model's experts are fused (Qwen2-/Qwen3-MoE keep ``experts.gate_up_proj``
``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]`` in memory, where the checkpoint, and
SGLang's ``load_weights``, name each expert's matrices ``experts.{e}.gate_proj.weight`` ...).
``save_pretrained`` converts back with the model's own conversion mapping
(``transformers.core_model_loading.revert_weight_conversion``), and so does this module: a weight
sync sends the checkpoint's names (SGLang 0.5.15-0.5.23's Qwen-MoE ``load_weights`` skips a fused
name *silently*: its experts would never be updated).

:class:`CheckpointLayout` (built once per model, from meta tensors: no memory, milliseconds):

- **sending** (the trainer): :meth:`checkpoint_tensors` reverts one in-memory tensor's *value*
  to its checkpoint tensors (transformers' conversion, one parameter at a time: what
  ``save_pretrained`` does; the pieces of a split are views where transformers makes views);
- **receiving** (local_engine): :meth:`write` puts one checkpoint tensor into its place in the
  fused in-memory tensor. The place comes from the same reverse conversion applied to an *index
  tensor* (``arange`` over the in-memory tensor, in its shape), computed the first time a
  source is written: every checkpoint tensor it yields holds the flat indices of the elements it
  is made of, so writing it is ``memory.view(-1)[index] = value``.

Names without a conversion map to themselves (a dense model's layout is the identity:
:attr:`identity`). Works under FSDP2 (the conversion is looked up by ``model_type`` when the
class is FSDP's wrapper).

Limits: :meth:`write`'s index tensors take 8 bytes per element of each converted tensor (fine
for the CPU models local_engine serves); only conversions that split one in-memory tensor into
checkpoint tensors by moving its elements (chunks, unbinds, transposes: the expert layouts) are
supported, others (several in-memory tensors into one checkpoint tensor, or a conversion that
computes, e.g. dequantises) raise ``NotImplementedError`` when the layout is built. The
conversions are those the model was loaded with (``_weight_conversions``), else transformers'
defaults for its type: a checkpoint already stored fused loads without one, and its names are
then sent as they are (SGLang cannot load such a checkpoint either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _revert(model: torch.nn.Module, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, named)


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor ``name`` of shape ``shape``, made of (part of) in-memory tensor ``source``."""

    name: str
    source: str
    shape: tuple[int, ...]

    @property
    def converted(self) -> bool:
        return self.name != self.source


class CheckpointLayout:
    """Checkpoint names ↔ in-memory tensors of one model (module docstring). ``names``: the
    in-memory names to cover (default: the whole state dict)."""

    def __init__(self, model: torch.nn.Module, names: list[str] | None = None) -> None:
        state = model.state_dict()
        self._model = model
        self.pieces: dict[str, list[Piece]] = {}
        for source in names if names is not None else list(state):
            shape = tuple(state[source].shape)
            reverted = _revert(model, {source: torch.empty(shape, device="meta")})
            if list(reverted) == [source]:
                self.pieces[source] = [Piece(source, source, shape)]
            else:
                self.pieces[source] = [Piece(name, source, tuple(t.shape)) for name, t in reverted.items()]
        self.by_name = {p.name: p for ps in self.pieces.values() for p in ps}
        if len(self.by_name) != sum(len(ps) for ps in self.pieces.values()):
            raise NotImplementedError("a checkpoint tensor made of several in-memory tensors (a many-to-one conversion) "
                                      "is not supported")
        bad = [source for source, ps in self.pieces.items()
               if sum(math.prod(p.shape) for p in ps) != math.prod(tuple(state[source].shape))]
        if bad:
            raise NotImplementedError(f"conversions that are not element moves are not supported: {', '.join(bad[:4])}")
        self._index: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def identity(self) -> bool:
        """True when every checkpoint name is an in-memory name (no conversion)."""
        return not any(p.converted for p in self.by_name.values())

    def is_converted(self, source: str) -> bool:
        return any(p.converted for p in self.pieces[source])

    def checkpoint_tensors(self, source: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint tensors made of in-memory tensor ``source`` (``full``: its whole,
        unsharded value), in :attr:`pieces` order."""
        if not self.is_converted(source):
            return [(source, full)]
        reverted = _revert(self._model, {source: full})
        return [(p.name, reverted[p.name]) for p in self.pieces[source]]

    def to_checkpoint(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``named`` (in-memory names, whole values) by checkpoint names, in the same order; a
        name the layout does not cover is kept (e.g. a LoRA-merged weight's plain name)."""
        return dict(piece for source, t in named.items()
                    for piece in (self.checkpoint_tensors(source, t) if source in self.pieces else [(source, t)]))

    def write(self, memory: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
        """Write checkpoint tensor ``name`` into the in-memory tensors ``memory`` (in place)."""
        p = self.by_name[name]
        dest = memory[p.source]
        with torch.no_grad():
            if not p.converted:
                dest.copy_(value)
                return
            index = self._indices(p.source, tuple(dest.shape))[name].to(dest.device)
            dest.view(-1)[index] = value.reshape(-1).to(dest.dtype)

    def _indices(self, source: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        if source not in self._index:
            index = torch.arange(int(torch.Size(shape).numel()), dtype=torch.long).view(shape)
            self._index[source] = {n: ix.reshape(-1).clone() for n, ix in _revert(self._model, {source: index}).items()}
        return self._index[source]
