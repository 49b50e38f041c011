"""Real peft adapters on the test engines' model, for tests of LoRA serving and adapter syncs."""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def make_adapter(base, path: Path, rank: int = 4, targets=("q_proj", "v_proj"), seed: int = 1):
    """A peft adapter with random A and B (``init_lora_weights=False``) on a copy of ``base``,
    saved at ``path`` with ``save_pretrained``; returns the peft model (eval mode)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                          init_lora_weights=False))
    model.save_pretrained(path)
    return model.eval()
