"""Packed rows and the chunked log-prob head keep the maths (issue 31): on fixed tensors, the
packed forward gives each sequence what it gets alone, the head's chunks give the full-logits
log-probs, entropies and gradients, and the layout places every scored token where the padded
path has it. (tests/trainer/test_trainer_step.py checks whole steps: same SGD update.)"""

from __future__ import annotations

import random

import pytest
import torch

from asyncrl.models import load_model
from asyncrl.wire import SamplingSpan
from tests.trainer.helpers import make_group
from trainer_daemon.algo import log_probs_and_entropy
from trainer_daemon.compute.batch import collate
from trainer_daemon.compute.logprob_head import chunked_log_probs, log_prob_head
from trainer_daemon.compute.packing import dummy_packed, pack, packed_attention_mask


def _trajs():
    rng = random.Random(3)
    trajs = make_group(rng, "a", 2) + make_group(rng, "b", 2)
    t = trajs[3]  # two turns: environment tokens (mask 0) between, and two temperatures
    trajs[3] = t.__class__(**{**{f: getattr(t, f) for f in t.__struct_fields__},
                             "token_ids": t.token_ids + [7, 8, 9], "loss_mask": [1, 1, 0, 0, 0, 1, 1],
                             "rollout_logprobs": [-6.5, -6.5, 0, 0, 0, -6.5, -6.5], "weight_versions": [0, 0, -1, -1, -1, 0, 0],
                             "sampling": [SamplingSpan(start=0, temperature=0.7), SamplingSpan(start=5, temperature=1.3)]})
    return trajs


@pytest.fixture(scope="module")
def model():
    return load_model("builtin:tiny", seed=0).float()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_packed_row_gives_every_sequence_what_it_gets_alone(model, impl):
    trajs = _trajs()
    pk = pack(trajs, [0, 1, 2, 3], [1.0] * 4, 0)
    old = model.config._attn_implementation
    model.config._attn_implementation = impl
    try:
        with torch.no_grad():
            packed = model.model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False,
                                 attention_mask=packed_attention_mask(pk.seq_lens, impl)).last_hidden_state[0]
            start = 0
            for t in trajs:
                alone = model.model(input_ids=torch.tensor([t.token_ids]), use_cache=False).last_hidden_state[0]
                torch.testing.assert_close(packed[start:start + len(t.token_ids)], alone, rtol=0, atol=1e-5)
                start += len(t.token_ids)
    finally:
        model.config._attn_implementation = old


def test_the_flex_block_mask_is_the_same_block_diagonal_causal_mask(model):
    """flex_attention is the CUDA path; on the CPU it runs forward only (no backward), enough to
    check the BlockMask (the first call compiles: ~30 s)."""
    trajs = _trajs()[:2]
    pk = pack(trajs, [0, 1], [1.0, 1.0], 0)
    old = model.config._attn_implementation
    model.config._attn_implementation = "flex_attention"
    try:
        with torch.no_grad():
            packed = model.model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False,
                                 attention_mask=packed_attention_mask(pk.seq_lens, "flex_attention")).last_hidden_state[0]
    finally:
        model.config._attn_implementation = old
    with torch.no_grad():
        start = 0
        for t in trajs:
            alone = model.model(input_ids=torch.tensor([t.token_ids]), use_cache=False).last_hidden_state[0]
            torch.testing.assert_close(packed[start:start + len(t.token_ids)], alone, rtol=0, atol=1e-5)
            start += len(t.token_ids)
    assert packed_attention_mask(pk.seq_lens, "flash_attention_2") is None  # varlen from position ids


def test_the_layout_scores_exactly_the_model_tokens_where_the_padded_path_has_them():
    trajs = _trajs()
    adv = [0.5, -0.5, 1.0, -1.0]
    pk, mb = pack(trajs, [0, 1, 2, 3], adv, 0), collate(trajs, [0, 1, 2, 3], adv, 0)
    for name in ("mask", "rollout_logp", "advantages"):
        assert torch.equal(getattr(pk, name), getattr(mb, name)), name
    assert pk.num_tokens == sum(len(t.token_ids) for t in trajs) and pk.labels.numel() == int(mb.mask.sum())
    b, r = pk.response_shape
    rows, offsets = pk.flat_index // r, pk.flat_index % r
    assert torch.equal(pk.labels, mb.labels[rows, offsets]) and torch.equal(pk.temperature, mb.temperature[rows, offsets])
    assert torch.equal(pk.input_ids[0, pk.score_pos + 1], pk.labels)  # the position before scores the token
    assert pk.temperature.unique().tolist() == pytest.approx([0.7, 1.0, 1.3])
    no_model_tokens = trajs[0].__class__(**{**{f: getattr(trajs[0], f) for f in trajs[0].__struct_fields__},
                                            "loss_mask": [0] * 4, "rollout_logprobs": [0.0] * 4, "weight_versions": [-1] * 4})
    lone = pack([no_model_tokens], [0], [1.0], 0)
    assert lone.score_pos.tolist() == [0] and lone.mask.sum() == 0  # still a graph for backward, masked out
    assert dummy_packed(0).dummy and dummy_packed(0).mask.sum() == 0


@pytest.mark.parametrize("chunk", [0, 1, 3, 1000])
@pytest.mark.parametrize("entropy", [None, "metric", "loss"])
def test_chunked_log_probs_equal_the_full_logits_and_their_gradients(chunk, entropy):
    torch.manual_seed(0)
    n, h, v = 11, 16, 50
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels, temps = torch.randint(0, v, (n,)), torch.rand(n) + 0.5
    logp_ref, ent_ref = log_probs_and_entropy(hidden @ weight.T / temps[:, None], labels, entropy_grad=entropy == "loss")
    out = chunked_log_probs(hidden, weight, None, labels, temps, chunk, entropy)
    torch.testing.assert_close(out[:, 0], logp_ref, rtol=0, atol=1e-6)
    loss_ref, loss = logp_ref.sum(), out[:, 0].sum()
    if entropy is not None:
        torch.testing.assert_close(out[:, 1], ent_ref, rtol=0, atol=1e-6)
        g_ent = torch.autograd.grad(out[:, 1].sum(), hidden, retain_graph=True)[0]
        assert (g_ent.abs().sum() > 0) == (entropy == "loss")  # a metric entropy sends no gradient back
        if entropy == "loss":
            loss_ref, loss = loss_ref + 0.3 * ent_ref.sum(), loss + 0.3 * out[:, 1].sum()
    g_ref = torch.autograd.grad(loss_ref, (hidden, weight))
    g = torch.autograd.grad(loss, (hidden, weight))
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("entropy", [None, "loss"])
def test_no_temperature_is_temperature_one_bit_for_bit(chunk, entropy):
    """The step passes None when every temperature is 1 (known on the host) to skip the
    division; the results and gradients are those of all-ones temperatures, exactly."""
    torch.manual_seed(1)
    n, h, v = 9, 16, 50
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    outs, grads = [], []
    for temps in (torch.ones(n), None):
        out = chunked_log_probs(hidden, weight, None, labels, temps, chunk, entropy)
        outs.append(out)
        grads.append(torch.autograd.grad(out.sum(), (hidden, weight)))
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_the_head_is_restored_and_refuses_positions_that_do_not_match_its_labels(model):
    head = model.get_output_embeddings()
    ids = torch.tensor([[5, 6, 7, 8]])
    with log_prob_head(model, torch.tensor([6, 7]), torch.ones(2), 1):
        out = model(input_ids=ids, logits_to_keep=torch.tensor([0, 1]), use_cache=False).logits
        with pytest.raises(ValueError, match="kept positions"):
            model(input_ids=ids, logits_to_keep=torch.tensor([0, 1, 2]), use_cache=False)
    assert out.shape == (1, 2, 1) and "forward" not in head.__dict__
    full = model(input_ids=ids, use_cache=False).logits[0, :2].float()
    torch.testing.assert_close(out[0, :, 0], torch.log_softmax(full, -1)[[0, 1], [6, 7]], rtol=0, atol=1e-5)
