"""Export a Hugging Face model directory from rank 0's full state dict: for serving, and for an
engine's ``/update_weights_from_disk``.

Writes ``model.safetensors`` (fp32, the trainer's master weights; ``lm_head.weight`` omitted when
the embeddings are tied, as ``save_pretrained`` does), ``config.json`` and the tokenizer files.
``asyncrl.models.load_model(<dir>)`` and local_engine load the directory as is.

With LoRA adapters (``actor.lora_rank``) ``model.safetensors`` holds the merged weights (what
the engines serve), and ``adapter/`` the adapter alone as peft saves it
(``adapter_model.safetensors``, ``adapter_config.json``): ``PeftModel.from_pretrained(base,
<dir>/adapter)`` or SGLang's ``--lora-paths name=<dir>/adapter`` on the base model.

Not covered: sharded safetensors (one file; fine up to a few GB), generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncrl.models import load_tokenizer
from trainer_daemon.policy.model import engine_weights


def export_hf(directory: Path, full: dict[str, torch.Tensor], model_config, actor, model, layout=None) -> Path:
    """Write the export into ``directory`` (created; ``actor`` and ``model``: the run's sections);
    returns it. ``layout`` (:class:`asyncrl.models.checkpoint_layout.CheckpointLayout`): the
    checkpoint names to write, as ``save_pretrained`` does (a MoE model's experts one matrix each);
    None: the in-memory names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(model_config, "tie_word_embeddings", False))
    a = actor
    scaling = a.lora_alpha / a.lora_rank if a.lora_rank else None
    weights = engine_weights(full, tied, lora_scaling=scaling)
    if layout is not None:
        weights = layout.to_checkpoint(weights)
    tensors = {k: v.detach().contiguous() for k, v in weights.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if scaling is not None:
        from trainer_daemon.policy.lora import adapter_config, adapter_targets, adapter_weights

        adapter = directory / "adapter"
        adapter.mkdir(exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in adapter_weights(full).items()},
                  str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
        doc = adapter_config(a.lora_rank, a.lora_alpha, adapter_targets(full), model.path)
        (adapter / "adapter_config.json").write_text(json.dumps(doc, indent=2, default=str))
    model_config.save_pretrained(directory)
    load_tokenizer(model.tokenizer_path or model.path).save_pretrained(directory)
    return directory
