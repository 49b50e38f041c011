"""Sampling masks (``return_sampling_mask``, SGLang 0.5.16+; issue 35): each output token's
support and its log-prob under the truncated distribution it was drawn from.

The sampler's values are checked on fixed logits against a direct computation; the engine's
against the reference model's teacher-forced logits truncated the same way; the release
switches (field present from 0.5.16, ``--sampling-mask-max-tokens`` from 0.5.20,
``sampling_logprobs_mode`` from 0.5.21) against engines emulating each side. The switches
themselves are read out of the wheels in tests/contract/test_release_facts.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.engine_client import EngineHTTPError
from local_engine.sampler import RowSampling, sample
from tests.helpers.processes import start_engine

PROMPT = [17, 301, 45, 922, 8, 77]
MASK = {"return_sampling_mask": True}


def _truncated_logprobs(logits: torch.Tensor, t: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """log of the top-k / top-p truncated, renormalised ``softmax(logits / T)`` (-inf outside)."""
    lp = torch.log_softmax(logits.double() / t, dim=-1)
    order = torch.argsort(lp, descending=True)
    keep = torch.zeros_like(lp, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k > 0 and rank >= top_k) or mass > top_p:
            break
        keep[i] = True
        mass += math.exp(lp[i])
    kept = lp.masked_fill(~keep, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1)


def test_the_sampler_reports_the_support_and_the_truncated_logprob():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 40, generator=gen) * 3
    rows = [RowSampling(temperature=0.8, top_k=5, sampling_mask=True),
            RowSampling(temperature=1.0, top_p=0.7, sampling_mask=True),
            RowSampling(temperature=0.0, sampling_mask=True),
            RowSampling(temperature=0.9, top_k=5)]
    out = sample(logits, rows, torch.Generator().manual_seed(0))
    assert out.masks[3] is None
    for i, (t, k, p) in enumerate([(0.8, 5, 1.0), (1.0, -1, 0.7)]):
        want = _truncated_logprobs(logits[i], t, k, p)
        mask, token = out.masks[i], out.token_ids[i]
        support = [j for j in torch.argsort(want, descending=True).tolist() if math.isfinite(want[j])]
        assert mask.support == support and token in support
        assert mask.selected_logprob == pytest.approx(float(want[token]), abs=1e-6)
        assert mask.support_logprobs == pytest.approx([float(want[j]) for j in support], abs=1e-6)
        # the reported logprob stays the untruncated one (SGLang's rule): lower by log Z
        assert out.logprobs[i] == pytest.approx(float(torch.log_softmax(logits[i] / t, -1)[token]), abs=1e-5)
        assert out.logprobs[i] < mask.selected_logprob
    assert out.masks[2].support == [out.token_ids[2]] and out.masks[2].selected_logprob == 0.0  # greedy: SGLang's rule


async def test_the_engine_answers_each_tokens_truncated_logprob(client, ref_model):
    params = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0.7, "top_k": 8}
    res = await client.generate(PROMPT, params, extra=MASK)
    meta = res.meta_info
    assert meta["output_token_sampling_mask_length"] == len(res.output_ids) == 16
    ids = torch.tensor([PROMPT + res.output_ids])
    with torch.no_grad():
        logits = ref_model(input_ids=ids).logits[0, len(PROMPT) - 1: -1].float()
    for j, token in enumerate(res.output_ids):
        want = _truncated_logprobs(logits[j], 0.7, top_k=8)
        assert meta["output_token_sampling_mask"][j] == torch.argsort(want, descending=True)[:8].tolist()
        assert res.sampling_logprobs[j] == pytest.approx(float(want[token]), abs=1e-4)
    assert all(s > lp for s, lp in zip(res.sampling_logprobs, res.logprobs, strict=True))


async def test_streamed_chunks_carry_the_masks_so_far(client):
    params = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 1.0, "top_k": 4}
    chunks = [r async for r in client.generate_stream(PROMPT, params, extra=MASK)]
    assert chunks[-1].meta_info["output_token_sampling_mask_length"] == 6
    for r in chunks:
        assert r.sampling_logprobs is not None and len(r.sampling_logprobs) == len(r.output_ids)


async def test_support_mode_answers_every_support_members_logprob(client):
    params = {"max_new_tokens": 4, "ignore_eos": True, "temperature": 1.0, "top_k": 3}
    res = await client.generate(PROMPT, params, extra={**MASK, "sampling_logprobs_mode": "support"})
    values, masks = res.meta_info["output_token_sampling_logprobs"], res.meta_info["output_token_sampling_mask"]
    assert res.sampling_logprobs is None  # not the selected mode's shape
    for token, support, lps in zip(res.output_ids, masks, values, strict=True):
        assert len(support) == len(lps) == 3 and token in support
        assert sum(math.exp(v) for v in lps) == pytest.approx(1.0, abs=1e-6)


async def test_a_support_over_the_limit_aborts_the_request_with_sglangs_400(tmp_path):
    with start_engine(tmp_path, "--sampling-mask-max-tokens", "3", name="capped") as engine:
        async with engine.client() as c:
            params = {"max_new_tokens": 4, "ignore_eos": True, "temperature": 1.0, "top_k": 5}
            with pytest.raises(EngineHTTPError) as refused:
                await c.generate(PROMPT, params, extra=MASK)
            assert refused.value.status == 400
            assert "Sampling support exceeds --sampling-mask-max-tokens=3" in str(refused.value)
            chunks = [r async for r in c.generate_stream(PROMPT, params, extra=MASK)]
            assert chunks[-1].finish_reason.type == "abort"
            ok = await c.generate(PROMPT, {**params, "top_k": 3}, extra=MASK)
            assert ok.finish_reason.type == "length"


@pytest.mark.parametrize(("release", "body", "refused"), [
    ("0.5.15", MASK, "return_sampling_mask needs sglang 0.5.16+"),
    ("0.5.20", {**MASK, "sampling_logprobs_mode": "selected"}, "sampling_logprobs_mode needs sglang 0.5.21+"),
    ("0.5.19", MASK, None),  # no --sampling-mask-max-tokens before 0.5.20: no bound
])
async def test_the_fields_follow_the_emulated_release(tmp_path, release, body, refused):
    with start_engine(tmp_path, "--sglang-compat", release, "--sampling-mask-max-tokens", "2", name=f"engine-{release}") as engine:
        async with engine.client() as c:
            params = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 1.0, "top_k": 5}
            if refused is None:
                res = await c.generate(PROMPT, params, extra=body)
                assert all(len(m) == 5 for m in res.meta_info["output_token_sampling_mask"])
                return
            with pytest.raises(EngineHTTPError, match=refused) as err:
                await c.generate(PROMPT, params, extra=body)
            assert err.value.status == 400
