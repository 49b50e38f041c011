"""asyncrl/models/checkpoint_layout.py: a MoE model's checkpoint names (what save_pretrained
writes and SGLang loads: one matrix per expert) against its fused in-memory tensors — the
checkpoint tensors equal transformers' own reverse conversion, element for element, writing them
back rebuilds the in-memory tensors exactly, and a dense model's layout is the identity."""

from __future__ import annotations

import torch
from transformers.core_model_loading import revert_weight_conversion

from asyncrl.models import load_model
from asyncrl.models.checkpoint_layout import CheckpointLayout


def test_the_moe_checkpoint_layout_is_transformers_own_and_writes_back_exactly():
    model = load_model("builtin:tiny-moe", seed=1)
    layout = CheckpointLayout(model)
    state = model.state_dict()
    assert not layout.identity and "model.layers.0.mlp.experts.7.up_proj.weight" in layout.by_name
    ours = dict(piece for name, t in state.items() for piece in layout.checkpoint_tensors(name, t))
    theirs = revert_weight_conversion(model, dict(state))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    other = load_model("builtin:tiny-moe", seed=2)
    memory = dict(other.state_dict(keep_vars=True))
    for name, value in ours.items():
        layout.write(memory, name, value)
    assert all(torch.equal(other.state_dict()[k], state[k]) for k in state)


def test_a_dense_models_layout_is_the_identity():
    layout = CheckpointLayout(load_model("builtin:tiny"))
    assert layout.identity and all(p.name == p.source for p in layout.by_name.values())
