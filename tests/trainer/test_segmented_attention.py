"""``segmented_sdpa`` (trainer_daemon/policy/segmented_attention.py), the CPU's attention for packed
rows: on fixed tensors it gives the dense block-diagonal mask's hidden states, log-probs, loss
and gradients, and it refuses what it cannot do."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from asyncrl.models import load_model
from tests.trainer.helpers import make_group
from trainer_daemon.algo import log_probs_from_logits
from trainer_daemon.compute.packing import pack, packed_attention_mask
from trainer_daemon.policy.model import set_attention
from trainer_daemon.policy.segmented_attention import NAME, cu_seq_lens, segmented_sdpa_forward


def _packed():
    """Five trajectories of five different lengths (3 extra response tokens per index)."""
    rng = random.Random(5)
    trajs = make_group(rng, "a", 3) + make_group(rng, "b", 2)
    longer = []
    for i, t in enumerate(trajs):
        extra = [rng.randrange(300, 1500) for _ in range(3 * i)]
        longer.append(msgspec.structs.replace(
            t, token_ids=t.token_ids + extra, loss_mask=t.loss_mask + [1] * len(extra),
            rollout_logprobs=t.rollout_logprobs + [-7.0] * len(extra), weight_versions=t.weight_versions + [0] * len(extra)))
    return pack(longer, list(range(len(longer))), [1.0] * len(longer), 0)


def _loss_and_grads(impl: str, pk) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model = load_model("builtin:tiny", seed=0).float()
    set_attention(model, impl)
    extra = {"cu_seq_lens_q": cu_seq_lens(pk.seq_lens)} if impl == NAME else {}
    logits = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False,
                   attention_mask=packed_attention_mask(pk.seq_lens, impl), **extra).logits[0]
    logp = log_probs_from_logits(logits[pk.score_pos], pk.labels)
    loss = -(logp * torch.linspace(0.5, 1.5, logp.numel())).sum()  # every token weighted differently
    loss.backward()
    return logp.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_log_probs_loss_and_gradients_equal_the_dense_block_diagonal_mask():
    pk = _packed()
    assert len(pk.seq_lens) == 5 and len(set(pk.seq_lens)) > 1
    dense, fast = _loss_and_grads("sdpa", pk), _loss_and_grads(NAME, pk)
    torch.testing.assert_close(fast[0], dense[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(fast[1], dense[1], rtol=1e-5, atol=1e-5)
    assert fast[2].keys() == dense[2].keys() and len(dense[2]) > 10
    for name, g in dense[2].items():
        torch.testing.assert_close(fast[2][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_without_boundaries_it_is_not_whole_row_causal_attention():
    """The boundaries matter: the same row as one sequence gives other log-probs (the test above
    would pass on plain causal attention only if packing changed nothing)."""
    pk = _packed()
    whole = _loss_and_grads(NAME, pk.__class__(**{**pk.__dict__, "seq_lens": [sum(pk.seq_lens)]}))[0]
    assert (whole - _loss_and_grads(NAME, pk)[0]).abs().max() > 1e-3


def test_position_ids_give_the_boundaries_when_cu_seq_lens_are_not_passed():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]])
    by_pos, _ = segmented_sdpa_forward(None, q, k, v, None, position_ids=pos)
    by_cu, _ = segmented_sdpa_forward(None, q, k, v, None, cu_seq_lens_q=cu_seq_lens([4, 2, 4]))
    torch.testing.assert_close(by_pos, by_cu, rtol=0, atol=0)
    assert by_cu.shape == (1, 10, 4, 8)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "needs the sequences' boundaries"),
    ({"cu_seq_lens_q": torch.tensor([0, 4, 9])}, "do not tile"),
    ({"cu_seq_lens_q": torch.tensor([0, 4, 4, 10])}, "do not tile"),
])
def test_it_refuses_what_it_cannot_do(kwargs, message):
    q = torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match=message):
        segmented_sdpa_forward(None, q, q, q, None, **kwargs)
    with pytest.raises(ValueError, match="one packed row"):
        segmented_sdpa_forward(None, torch.randn(2, 2, 10, 8), q, q, None, cu_seq_lens_q=cu_seq_lens([10]))


def test_runs_of_equal_lengths_batched_in_one_call_give_the_same_outputs_and_gradients():
    """Issue 49: consecutive sequences of one length go through SDPA as one batch (a view of the
    row). On fixed tensors: the output and the gradients of q, k and v equal those of one call
    per sequence, for rows of equal lengths, mixed runs, and grouped-query heads."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    for lens, heads_kv in (([6, 6, 6, 6], 2), ([4, 4, 7, 3, 3, 3, 5], 4), ([9], 2), ([2, 5, 2, 5], 1)):
        t = sum(lens)
        q = torch.randn(1, 4, t, 8, requires_grad=True)
        k = torch.randn(1, heads_kv, t, 8, requires_grad=True)
        v = torch.randn(1, heads_kv, t, 8, requires_grad=True)
        weights = torch.randn(1, t, 4, 8)
        fast, _ = segmented_sdpa_forward(None, q, k, v, None, cu_seq_lens_q=cu_seq_lens(lens))
        (fast * weights).sum().backward()
        fast_grads = [x.grad.clone() for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        edges = cu_seq_lens(lens).tolist()
        simple = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                           enable_gqa=heads_kv != 4)
                            for s, e in zip(edges[:-1], edges[1:])], dim=2).transpose(1, 2)
        (simple * weights).sum().backward()
        torch.testing.assert_close(fast, simple, rtol=0, atol=1e-6, msg=str(lens))
        for got, x in zip(fast_grads, (q, k, v)):
            torch.testing.assert_close(got, x.grad, rtol=0, atol=1e-5, msg=str(lens))
