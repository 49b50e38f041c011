"""local_engine.sampler in-process: the sampled distribution, truncation, bans, logprobs."""

from __future__ import annotations

import torch

from local_engine.sampler import RowSampling, prompt_logprobs, sample

N = 20000


def _freqs(logits: torch.Tensor, row: RowSampling, seed: int = 0) -> tuple[torch.Tensor, list[float], list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = sample(logits.expand(N, -1), [row] * N, g)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[-1]).double()
    return counts / N, out.logprobs, out.token_ids


def test_sampling_follows_softmax_of_logits_over_t():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    freq, logprobs, ids = _freqs(logits, RowSampling(temperature=0.7))
    expected = torch.softmax(logits[0] / 0.7, -1).double()
    assert (freq - expected).abs().max() < 0.015
    lp = torch.log_softmax(logits[0] / 0.7, -1)
    assert all(abs(lp[t].item() - v) < 1e-6 for t, v in zip(ids[:50], logprobs[:50], strict=True))


def test_top_k_top_p_min_p_restrict_support_but_not_logprobs():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -2.0]])
    freq, logprobs, ids = _freqs(logits, RowSampling(temperature=1.0, top_k=2))
    assert freq[2:].sum() == 0 and freq[0] > freq[1] > 0.2
    lp = torch.log_softmax(logits[0], -1)
    assert abs(logprobs[0] - lp[ids[0]].item()) < 1e-6  # untruncated distribution
    p = torch.softmax(logits[0], -1)
    freq, _, _ = _freqs(logits, RowSampling(top_p=float(p[0] + p[1] - 0.01)))
    assert freq[2:].sum() == 0 and freq[1] > 0
    freq, _, _ = _freqs(logits, RowSampling(min_p=0.5))  # keeps p >= 0.5 * max: ids 0, 1 (0.61), not 2 (0.37)
    assert freq[2:].sum() == 0 and freq[1] > 0


def test_greedy_bans_and_per_request_seed():
    logits = torch.tensor([[1.0, 5.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, [RowSampling(temperature=0.0)], g).token_ids == [1]
    assert sample(logits, [RowSampling(temperature=0.0, banned=[1])], g).token_ids == [2]
    out = sample(logits.expand(200, -1), [RowSampling(banned=[1, 2])] * 200, g)
    assert set(out.token_ids) == {0}

    torch.manual_seed(3)
    base = torch.randn(1, 50)
    a = sample(base, [RowSampling(generator=torch.Generator().manual_seed(42))], torch.Generator().manual_seed(1)).token_ids[0]
    b = sample(torch.cat([base, torch.randn(5, 50)]), [RowSampling(generator=torch.Generator().manual_seed(42))] + [RowSampling()] * 5,
               torch.Generator().manual_seed(2)).token_ids[0]
    assert a == b


def test_prompt_logprobs():
    logits = torch.randn(4, 10)
    out = prompt_logprobs(logits, [3, 1, 4, 1], temperature=0.0)
    lp = torch.log_softmax(logits, -1)
    assert out[0] is None and [round(v, 5) for v in out[1:]] == [round(lp[j, t].item(), 5) for j, t in enumerate([1, 4, 1])]
