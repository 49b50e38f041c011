"""Token log-probs / entropy against numpy, and the analytic gradient of log-softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer_daemon.algo.logprobs import (
    entropy_from_logits,
    log_probs_and_entropy,
    log_probs_from_logits,
)

RNG = np.random.default_rng(7)
LOGITS = RNG.normal(scale=3.0, size=(2, 3, 5))
LABELS = np.array([[0, 4, 2], [1, 1, 3]])


def np_reference(logits, labels, temperature):
    z = logits / temperature
    out_lp = np.zeros(labels.shape)
    out_h = np.zeros(labels.shape)
    for i in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            row = z[i, t]
            e = np.exp(row - row.max())
            p = e / e.sum()
            out_lp[i, t] = np.log(p[labels[i, t]])
            out_h[i, t] = -(p * np.log(p)).sum()
    return out_lp, out_h


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_log_probs_and_entropy_match_numpy(temperature):
    want_lp, want_h = np_reference(LOGITS, LABELS, temperature)
    logits = torch.tensor(LOGITS, dtype=torch.float32)
    labels = torch.tensor(LABELS)
    lp = log_probs_from_logits(logits, labels, temperature)
    h = entropy_from_logits(logits, temperature)
    lp2, h2 = log_probs_and_entropy(logits, labels, temperature)
    assert lp.dtype == h.dtype == torch.float32 and lp.shape == (2, 3)
    np.testing.assert_allclose(lp.numpy(), want_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h.numpy(), want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp2, lp)
    torch.testing.assert_close(h2, h)


def test_low_precision_logits_are_upcast():
    logits = torch.tensor(LOGITS).to(torch.bfloat16)
    lp = log_probs_from_logits(logits, torch.tensor(LABELS))
    assert lp.dtype == torch.float32
    want, _ = np_reference(logits.float().numpy().astype(np.float64), LABELS, 1.0)
    np.testing.assert_allclose(lp.numpy(), want, rtol=1e-5, atol=1e-5)


def test_log_prob_gradient_is_onehot_minus_softmax_over_t():
    temperature = 0.8
    logits = torch.tensor(LOGITS, dtype=torch.float32, requires_grad=True)
    log_probs_from_logits(logits, torch.tensor(LABELS), temperature).sum().backward()
    z = LOGITS / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    onehot = np.eye(5)[LABELS]
    np.testing.assert_allclose(
        logits.grad.numpy(), (onehot - p) / temperature, rtol=1e-4, atol=1e-6
    )


def test_errors():
    with pytest.raises(ValueError):
        log_probs_from_logits(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError):
        entropy_from_logits(torch.zeros(2, 5), temperature=0.0)
