"""LoRA adapters on the policy (``actor.lora_rank > 0``), with peft.

:func:`add_adapters` injects peft's LoRA layers into the Hugging Face model in place
(``peft.inject_adapter_in_model``: the model keeps its class, its ``model``/``lm_head``
attributes and its config) and freezes everything but the adapters, before sharding. Each
target ``Linear`` becomes ``<module>.base_layer`` (the frozen weight) plus
``<module>.lora_A.default`` (rank x in) and ``<module>.lora_B.default`` (out x rank, zero at
start, so the adapted model starts as the base model).

Names in the trainer's state dict therefore differ from the base model's. Two views of it:

- :func:`merged_weights`: what an engine without adapters serves — each target's weight as
  ``W + (B @ A) * lora_alpha / lora_rank`` under the base model's name (peft's own merge),
  the base layers' other tensors renamed back; the full-weight sync and ``export_hf`` use it;
- :func:`adapter_weights`: the adapter alone in peft's saved format
  (``base_model.model.<module>.lora_A.weight``), which ``PeftModel.from_pretrained`` and
  SGLang's ``--lora-paths`` load, with :func:`adapter_config` as its ``adapter_config.json``;
  :func:`adapter_snapshot` gathers only the adapter (no base weight) for an adapter sync.

Limits: plain LoRA (no DoRA, rsLoRA, biases, dropout, or ``modules_to_save``); the output
layer and the embeddings are never adapted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADAPTER = "default"
BASE = ".base_layer."
LORA_A, LORA_B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


@dataclass(frozen=True)
class AdapterSnapshot:
    """One version's adapter: peft's saved names → CPU tensors, and its ``adapter_config.json``."""

    tensors: dict[str, torch.Tensor]
    config: dict

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def lora_config(rank: int, alpha: float, target_modules: str | list[str]):
    """peft's ``LoraConfig`` for the ``actor.lora_*`` settings (imported here: peft is the
    ``lora`` extra, loaded only when a run asks for adapters)."""
    try:
        from peft import LoraConfig
    except ImportError as exc:
        raise RuntimeError("actor.lora_rank > 0 needs peft: pip install 'asyncrl[lora]'") from exc
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none")


def add_adapters(model: torch.nn.Module, rank: int, alpha: float, target_modules: str | list[str]) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` in place and leave only them trainable. A target
    that matches no module raises ValueError naming ``actor.target_modules``."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(lora_config(rank, alpha, target_modules), model)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError is one
        raise ValueError(f"actor.target_modules={target_modules!r}: {exc}") from exc
    for name, p in model.named_parameters():
        p.requires_grad_(LORA_A in name or LORA_B in name)
    return model


def has_adapters(names) -> bool:
    """Whether a state dict's names (or a model's parameter names) carry LoRA adapters."""
    return any(LORA_A in n for n in names)


def merged_weights(full: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The base model's names and shapes, each adapted weight merged (module docstring);
    ``scaling`` = ``lora_alpha / lora_rank``. Computed in float32 whatever the stored dtype."""
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if LORA_A in name or LORA_B in name:
            continue
        if BASE not in name:
            out[name] = t
            continue
        module, _, leaf = name.partition(BASE)
        plain = f"{module}.{leaf}"
        if leaf == "weight" and f"{module}{LORA_A}" in full:
            a, b = full[f"{module}{LORA_A}"], full[f"{module}{LORA_B}"]
            delta = (b.float() @ a.float()) * scaling
            out[plain] = (t.float() + delta).to(t.dtype)
        else:
            out[plain] = t
    return out


def adapter_weights(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names peft saves them with."""
    out = {}
    for name, t in full.items():
        for marker, saved in ((LORA_A, ".lora_A.weight"), (LORA_B, ".lora_B.weight")):
            if marker in name:
                out["base_model.model." + name.replace(marker, saved)] = t
    return out


def adapter_targets(full: dict[str, torch.Tensor]) -> list[str]:
    """The adapted modules' own names (``q_proj``...), as peft resolved ``target_modules``."""
    return sorted({n.split(LORA_A)[0].rsplit(".", 1)[-1] for n in full if LORA_A in n})


def adapter_config(rank: int, alpha: float, targets: list[str], base_model: str) -> dict:
    """``adapter_config.json`` of :func:`adapter_weights` (peft's own serialisation of the
    config; ``targets`` from :func:`adapter_targets`)."""
    cfg = lora_config(rank, alpha, targets)
    cfg.base_model_name_or_path = base_model
    cfg.task_type = "CAUSAL_LM"
    doc = cfg.to_dict()
    doc["target_modules"] = sorted(doc["target_modules"])
    return doc


def adapter_snapshot(model: torch.nn.Module, actor, base_model: str, dtype: torch.dtype, write: bool):
    """*Collective.* The adapter of the current parameters as an adapter sync publishes it
    (:class:`AdapterSnapshot`, tensors in ``dtype``; rank and alpha
    from the ``actor`` section, ``base_model`` named in its config): every rank
    gathers the trainable parameters only; rank 0 (``write``) gets the snapshot, others None."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule


    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    trained = get_model_state_dict(model, options=opts)
    if not write:
        return None
    if not isinstance(model, FSDPModule):  # one rank (not sharded): these are the live parameters
        trained = {k: t.detach().clone() for k, t in trained.items()}
    a = actor
    tensors = {k: t.to(dtype) for k, t in adapter_weights(trained).items()}
    return AdapterSnapshot(tensors, adapter_config(a.lora_rank, a.lora_alpha, adapter_targets(trained), base_model))
