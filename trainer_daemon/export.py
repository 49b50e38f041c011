"""Export a Hugging Face model directory from rank 0's full state dict: for serving, and for an
engine's ``/update_weights_from_disk``.

Writes ``model.safetensors`` (fp32, the trainer's master weights; ``lm_head.weight`` omitted when
the embeddings are tied, as ``save_pretrained`` does), ``config.json`` and the tokenizer files.
``asyncrl.models.load_model(<dir>)`` and local_engine load the directory as is.

Not covered: sharded safetensors (one file; fine up to a few GB), generation_config.json.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncrl.models import load_tokenizer
from trainer_daemon.model import engine_weights


def export_hf(directory: Path, full: dict[str, torch.Tensor], model_config, cfg) -> Path:
    """Write the export into ``directory`` (created); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(model_config, "tie_word_embeddings", False))
    tensors = {k: v.detach().contiguous() for k, v in engine_weights(full, tied).items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model_config.save_pretrained(directory)
    load_tokenizer(cfg.model.tokenizer_path or cfg.model.path).save_pretrained(directory)
    return directory
