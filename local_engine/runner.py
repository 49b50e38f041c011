"""Model compute behind a small interface: a batch of rows, each one sequence's KV cache.

The scheduler only talks to a :class:`ModelRunner`; it never touches tensors of the cache.
A runner holds *rows* (one per running request, in the scheduler's order) and offers:

- ``prefill(prompts, full_logits, adapters, prefixes)`` — run new sequences and append them as
  rows at the end, each row with its LoRA adapter (or None: the base model) for this and every
  later step; returns their last-position logits (and all prompt-position logits where asked).
  A row given a prefix (:meth:`export_prefix` of an earlier row) takes its first tokens' KV
  from it as it is, whatever the weights now, and computes only the rest (SGLang's radix-cache
  hit: what a retracted request's re-prefill gets where no flush dropped its prompt's KV);
- ``export_prefix(row, n)`` — a copy of the KV of the first ``n`` tokens of a row (None where
  the runner keeps no KV);
- ``decode(tokens)`` — feed one token per row, return next-token logits for every row;
- ``keep(indices)`` — drop every row not listed (order preserved);
- ``reset()`` — drop all rows.

Logits come back as fp32 ``[rows, vocab]`` tensors on the runner's device (the sampler works
there and hands back Python numbers). Every method is blocking and is meant to run in one
worker thread at a time (the scheduler guarantees this); none is thread-safe.

:class:`HFModelRunner` implements it on a transformers causal LM with a batched KV cache:
rows are left-padded to a common length, a 2-D attention mask marks padding and per-row
``position_ids`` count only real tokens, so a row's numbers do not depend on its
neighbours (checked against a teacher-forced forward pass to ~1e-6 in fp32). New rows
are prefilled as their own left-padded batch and merged by left-padding the shorter cache
along the sequence dimension; columns that are padding in every row are trimmed after
rows leave. The cache layers grow geometrically instead of concatenating on every step.

Device: the runner follows the model. Every tensor it creates (input ids, masks, positions,
lengths, row indices; the KV cache derives from the model's outputs) is built on
``runner.device``, the device of the model's parameters, in one host-to-device copy per
argument; :func:`resolve_device` turns ``--device`` into a ``torch.device`` and refuses
``cuda`` where torch sees no GPU. On CUDA the model runs in the dtype it was loaded in
(``--dtype bfloat16``) with transformers' default attention (SDPA); nothing is custom.

Not covered: sliding-window or linear-attention layers (refused at start), paged
attention, prefix sharing inside one prefill batch (a prefix crosses requests only as an
exported one: :mod:`local_engine.prefix_cache`),
chunked prefill, CUDA graphs, more than one GPU
(``cuda`` means the current CUDA device).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from local_engine.lora_compute import AdapterWeights, LoraLayers

# Growth factor of a cache layer's buffer when a step does not fit: amortises the copy
# that plain DynamicCache pays on every decode step.
CACHE_GROWTH = 1.5
# Smallest buffer (tokens) a cache layer allocates, so the first decode steps never copy.
CACHE_MIN_CAPACITY = 64


def resolve_device(name: str) -> torch.device:
    """``--device`` as a ``torch.device``; raises ValueError naming the device when it is
    not usable here (``cuda`` without a CUDA build of torch or without a visible GPU)."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU-only build" if torch.version.cuda is None
                   else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
            raise ValueError(f"device 'cuda' was asked for (--device cuda) but CUDA is not available: {why}; "
                             "use --device cpu")
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"unknown device {name!r}: use 'cpu' or 'cuda'")


@dataclass
class PrefillOutput:
    """Logits of a prefill: ``last`` is ``[n, vocab]`` fp32 for the last prompt position of
    each new row; ``prompt[i]`` is ``[len_i, vocab]`` fp32 (position j predicts token j+1)
    for rows that asked for prompt logits, else None."""

    last: torch.Tensor
    prompt: list[torch.Tensor | None]
    routes: list[torch.Tensor] | None = None
    """With a route recorder: per new row, the routed experts ``[computed positions, layers,
    top_k]`` (int32, CPU) of the positions this prefill computed (after a given prefix)."""


class ModelRunner(ABC):
    """Batched model compute. See the module docstring for the contract."""

    vocab_size: int

    @property
    @abstractmethod
    def num_rows(self) -> int: ...

    @abstractmethod
    def prefill(self, prompts: list[list[int]], full_logits: list[bool], adapters: list | None = None,
                prefixes: list | None = None) -> PrefillOutput: ...

    def export_prefix(self, row: int, n: int) -> object | None:
        """The KV of the first ``n`` tokens of ``row``, for a later :meth:`prefill` (module
        docstring); None: this runner keeps none (its prefills then compute everything)."""
        return None

    @abstractmethod
    def decode(self, tokens: list[int]) -> torch.Tensor: ...

    decode_routes: torch.Tensor | None = None
    """With a route recorder: the last :meth:`decode`'s routed experts ``[rows, layers, top_k]``."""

    @abstractmethod
    def keep(self, indices: list[int]) -> None: ...

    @abstractmethod
    def reset(self) -> None: ...

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Tensors a weight update may write, by the Hugging Face names (aliases included)."""
        return {}

    def weight_layout(self):
        """The checkpoint names of :meth:`named_weights` where they differ (a MoE model's
        experts: :class:`asyncrl.models.checkpoint_layout.CheckpointLayout`); None: the same."""
        return None


def _growable_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowableLayer(DynamicLayer):
        """A DynamicLayer whose keys/values are views into a buffer with spare capacity."""

        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            self._kbuf = self._vbuf = None
            self._len = 0

        def set_states(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Replace the whole cache of this layer (``[B, H, L, D]``)."""
            self.is_initialized = True
            self.dtype, self.device = keys.dtype, keys.device
            self._kbuf, self._vbuf, self._len = keys, values, keys.shape[-2]
            self.keys, self.values = keys, values

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            if self._kbuf is None or self._kbuf.shape[0] != key_states.shape[0]:
                self.set_states(key_states.contiguous(), value_states.contiguous())
                return self.keys, self.values
            need = self._len + n
            if need > self._kbuf.shape[-2]:
                cap = max(need, int(self._kbuf.shape[-2] * CACHE_GROWTH), CACHE_MIN_CAPACITY)
                b, h, _, d = self._kbuf.shape
                kbuf = self._kbuf.new_empty((b, h, cap, d))
                vbuf = self._vbuf.new_empty((b, h, cap, d))
                kbuf[:, :, : self._len] = self._kbuf[:, :, : self._len]
                vbuf[:, :, : self._len] = self._vbuf[:, :, : self._len]
                self._kbuf, self._vbuf = kbuf, vbuf
            self._kbuf[:, :, self._len : need] = key_states
            self._vbuf[:, :, self._len : need] = value_states
            self._len = need
            self.keys = self._kbuf[:, :, :need]
            self.values = self._vbuf[:, :, :need]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self._len if self.is_initialized and self._kbuf is not None else 0

    return GrowableLayer


class HFModelRunner(ModelRunner):
    """:class:`ModelRunner` over a transformers causal LM (eval mode, no grad) on the device
    of its parameters (``self.device``)."""

    def __init__(self, model, pad_token_id: int = 0, routes=None):
        from transformers import DynamicCache

        self.routes = routes
        """A :class:`local_engine.routes.RouteRecorder` on ``model`` (None: no routes recorded)."""
        self.model = model
        self.config = model.config
        self.device: torch.device = next(model.parameters()).device
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.pad_token_id = pad_token_id if 0 <= pad_token_id < self.vocab_size else 0
        probe = DynamicCache(config=self.config)
        if any(type(layer).__name__ != "DynamicLayer" for layer in probe.layers):
            kinds = sorted({type(layer).__name__ for layer in probe.layers})
            raise ValueError(f"local_engine supports full-attention models only; this model has cache layers {kinds}")
        self._n_layers = len(probe.layers) or int(self.config.num_hidden_layers)
        self._layer_cls = _growable_layer_class()
        self._cache = None
        self._mask: torch.Tensor | None = None  # [rows, L] long, 1 = real token
        self._lengths: torch.Tensor | None = None  # [rows] real tokens per row
        self.lora: LoraLayers | None = None
        """Per-row adapters (set by the engine when it serves LoRA: local_engine.lora_compute)."""
        self._adapters: list[AdapterWeights | None] = []  # per row

    # -- state ---------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return 0 if self._mask is None else int(self._mask.shape[0])

    @property
    def cache_len(self) -> int:
        return 0 if self._mask is None else int(self._mask.shape[1])

    def reset(self) -> None:
        self._cache = self._mask = self._lengths = None
        self._adapters = []

    def _rows(self, adapters: list[AdapterWeights | None]):
        return self.lora.rows(adapters) if self.lora is not None else nullcontext()

    def _new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        cache.layers = [self._layer_cls() for _ in range(self._n_layers)]
        return cache

    def _layer_states(self, cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _set_states(self, states: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, lengths: torch.Tensor) -> None:
        cache = self._new_cache()
        for layer, (k, v) in zip(cache.layers, states, strict=True):
            layer.set_states(k, v)
        self._cache, self._mask, self._lengths = cache, mask, lengths

    def keep(self, indices: list[int]) -> None:
        if self._mask is None:
            return
        if not indices:
            self.reset()
            return
        if indices == list(range(self.num_rows)):
            return
        self._adapters = [self._adapters[i] for i in indices]
        idx = torch.tensor(indices, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, idx)
        trim = int((mask.sum(0) == 0).long().cumprod(0).sum())  # leading all-padding columns
        states = [
            (k.index_select(0, idx)[:, :, trim:].contiguous(), v.index_select(0, idx)[:, :, trim:].contiguous())
            for k, v in self._layer_states(self._cache)
        ]
        self._set_states(states, mask[:, trim:].contiguous(), self._lengths.index_select(0, idx))

    def export_prefix(self, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        if self._mask is None or not 0 <= row < self.num_rows or not 0 < n <= int(self._lengths[row]):
            return None
        start = self.cache_len - int(self._lengths[row])  # rows are left-padded
        return [(k[row:row + 1, :, start:start + n].clone(), v[row:row + 1, :, start:start + n].clone())
                for k, v in self._layer_states(self._cache)]

    # -- compute -------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], full_logits: list[bool], adapters: list | None = None,
                prefixes: list | None = None) -> PrefillOutput:
        adapters = list(adapters) if adapters is not None else [None] * len(prompts)
        if any(a is not None for a in adapters) and self.lora is None:
            raise RuntimeError("a row asks for a LoRA adapter but this runner serves none")
        if prefixes is not None and any(p is not None for p in prefixes):
            outs = [self._prefill_over_prefix(p, f, a, pre) for p, f, a, pre in zip(prompts, full_logits, adapters, prefixes, strict=True)]
            routes = [o.routes[0] for o in outs] if self.routes is not None else None
            return PrefillOutput(last=torch.cat([o.last for o in outs]), prompt=[o.prompt[0] for o in outs], routes=routes)
        width = max(len(p) for p in prompts)
        # Left-padded rows built as lists: one host-to-device copy per tensor, not one per row.
        ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts],
                           dtype=torch.long, device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = self._new_cache()
        keep_all = any(full_logits)
        with self._rows(adapters):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=0 if keep_all else 1,
            )
        logits = out.logits
        last = logits[:, -1, :].float()
        prompt: list[torch.Tensor | None] = [
            logits[i, width - len(p) :, :].float() if want else None
            for i, (p, want) in enumerate(zip(prompts, full_logits, strict=True))
        ]
        self._merge(cache, mask, torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device))
        self._adapters = self._adapters + adapters
        routes = None
        if self.routes is not None:
            taken = self.routes.take().reshape(len(prompts), width, self.routes.layers, self.routes.top_k)
            routes = [taken[i, width - len(p):] for i, p in enumerate(prompts)]  # left padding dropped
        return PrefillOutput(last=last, prompt=prompt, routes=routes)

    def _prefill_over_prefix(self, prompt: list[int], full: bool, adapter, prefix) -> PrefillOutput:
        """One row, appended: ``prefix``'s KV for its first tokens (None: none), the rest computed."""
        if prefix is None:
            return self.prefill([prompt], [full], [adapter])
        n = int(prefix[0][0].shape[-2])
        if full or not 0 < n < len(prompt):
            raise RuntimeError(f"a prefix of {n} tokens cannot serve a prefill of {len(prompt)} tokens (prompt logits: {full})")
        cache = self._new_cache()
        for layer, (k, v) in zip(cache.layers, prefix, strict=True):
            layer.set_states(k.clone(), v.clone())
        mask = torch.ones((1, len(prompt)), dtype=torch.long, device=self.device)
        positions = torch.arange(n, len(prompt), device=self.device).unsqueeze(0)
        with self._rows([adapter]):
            out = self.model(input_ids=torch.tensor([prompt[n:]], dtype=torch.long, device=self.device), attention_mask=mask,
                             position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._merge(cache, mask, torch.tensor([len(prompt)], dtype=torch.long, device=self.device))
        self._adapters = self._adapters + [adapter]
        routes = [self.routes.take()] if self.routes is not None else None  # positions n.. only
        return PrefillOutput(last=out.logits[:, -1, :].float(), prompt=[None], routes=routes)

    def _merge(self, cache, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        new_states = self._layer_states(cache)
        if self._mask is None:
            self._set_states([(k.contiguous(), v.contiguous()) for k, v in new_states], mask, lengths)
            return
        old_states = self._layer_states(self._cache)
        width = max(self.cache_len, mask.shape[1])

        def pad(t: torch.Tensor, extra: int) -> torch.Tensor:
            if extra == 0:
                return t
            b, h, _, d = t.shape
            return torch.cat([t.new_zeros((b, h, extra, d)), t], dim=2)

        pad_old, pad_new = width - self.cache_len, width - mask.shape[1]
        states = [
            (torch.cat([pad(ko, pad_old), pad(kn, pad_new)], 0), torch.cat([pad(vo, pad_old), pad(vn, pad_new)], 0))
            for (ko, vo), (kn, vn) in zip(old_states, new_states, strict=True)
        ]
        merged_mask = torch.cat(
            [
                torch.cat([self._mask.new_zeros((self.num_rows, pad_old)), self._mask], 1),
                torch.cat([mask.new_zeros((mask.shape[0], pad_new)), mask], 1),
            ],
            0,
        )
        self._set_states(states, merged_mask, torch.cat([self._lengths, lengths]))

    @torch.inference_mode()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        if self._mask is None or len(tokens) != self.num_rows:
            raise RuntimeError(f"decode got {len(tokens)} tokens for {self.num_rows} rows")
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        self._mask = torch.cat([self._mask, self._mask.new_ones((self.num_rows, 1))], 1)
        positions = self._lengths.unsqueeze(1).clone()
        with self._rows(self._adapters):
            out = self.model(
                input_ids=ids,
                attention_mask=self._mask,
                position_ids=positions,
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
        self._lengths = self._lengths + 1
        if self.routes is not None:
            self.decode_routes = self.routes.take()  # [rows, layers, top_k]: one position per row
        return out.logits[:, -1, :].float()

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The state dict (persistent floating tensors; tied weights under both names)."""
        return {k: v for k, v in self.model.state_dict(keep_vars=True).items() if v.is_floating_point()}

    def weight_layout(self):
        from asyncrl.models.checkpoint_layout import CheckpointLayout

        layout = CheckpointLayout(self.model, list(self.named_weights()))
        return None if layout.identity else layout
