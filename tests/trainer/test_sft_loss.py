"""The warm-up's SFT loss (trainer_daemon/sft.py): running the rows' common prefix once and
projecting only the learned positions gives the plain computation's loss and gradients."""

from __future__ import annotations

import torch

from asyncrl.models import load_model
from trainer_daemon.sft import masked_lm_loss, shared_prefix_length


def full_projection_loss(model, ids, mask, attn):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    weights = mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
    return (nll * weights.reshape(-1)).sum() / weights.sum()


def test_shared_prefix_and_masked_projection_match_the_plain_computation():
    torch.manual_seed(0)
    model = load_model("builtin:tiny")
    ids = torch.randint(0, model.config.vocab_size, (3, 24))
    ids[:, :10] = ids[0, :10]  # a common prefix (the demo's system prompt), run once
    ids[1, 10] = ids[0, 10] + 1
    attn = torch.ones_like(ids)
    attn[2, 18:] = 0  # a padded row
    assert shared_prefix_length(ids, attn) == 10
    mask = torch.zeros(3, 24)
    mask[0, 5:9] = mask[1, 12:20] = mask[2, 3:7] = 1
    got = masked_lm_loss(model, ids, mask, attn)
    got.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = full_projection_loss(model, ids, mask, attn)
    want.backward()
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    for g, p in zip(grads, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)
    assert masked_lm_loss(model, ids, torch.zeros(3, 24), attn).item() == 0.0  # nothing to learn: 0, not NaN
