"""KL estimators against scalar math."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_daemon.algo.kl import kl_penalty

LOGP = [-0.5, -2.0, -0.1, -30.0, -0.01, -3.0]
REF = [-0.7, -1.0, -0.1, -0.02, -25.0, -8.0]


def k3(lp, rp):
    d = min(max(rp - lp, -20.0), 20.0)
    return min(max(math.exp(d) - d - 1.0, -10.0), 10.0)


EXPECTED = {
    "kl": lambda lp, rp: lp - rp,
    "abs": lambda lp, rp: abs(lp - rp),
    "mse": lambda lp, rp: 0.5 * (lp - rp) ** 2,
    "low_var_kl": k3,
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_estimators_elementwise(kind):
    got = kl_penalty(
        torch.tensor(LOGP, dtype=torch.float64), torch.tensor(REF, dtype=torch.float64), kind
    )
    for g, lp, rp in zip(got.tolist(), LOGP, REF, strict=True):
        assert math.isclose(g, EXPECTED[kind](lp, rp), rel_tol=1e-12, abs_tol=1e-15)


def test_low_var_kl_values_and_clamps():
    got = kl_penalty(
        torch.tensor(LOGP, dtype=torch.float64),
        torch.tensor(REF, dtype=torch.float64),
        "low_var_kl",
    )
    assert got[2].item() == 0.0  # identical log-probs
    assert got[3].item() == 10.0  # ref - logp = 29.98 -> clamp(exp(20) - 21) -> 10
    assert got[4].item() == 10.0  # ref - logp = -24.99 -> clamp to -20 -> exp(-20) + 19 -> 10
    assert math.isclose(got[5].item(), math.exp(-5.0) + 5.0 - 1.0, rel_tol=1e-12)
    assert (got >= 0).all()


def test_aliases_and_unknown():
    lp, rp = torch.tensor(LOGP), torch.tensor(REF)
    torch.testing.assert_close(kl_penalty(lp, rp, "k1"), kl_penalty(lp, rp, "kl"))
    torch.testing.assert_close(kl_penalty(lp, rp, "k2"), kl_penalty(lp, rp, "mse"))
    torch.testing.assert_close(kl_penalty(lp, rp, "k3"), kl_penalty(lp, rp, "low_var_kl"))
    with pytest.raises(ValueError):
        kl_penalty(lp, rp, "full")


def test_low_var_kl_gradient():
    """d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp) inside the clamps, 0 outside."""
    lp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    kl_penalty(lp, torch.tensor(REF, dtype=torch.float64), "low_var_kl").sum().backward()
    for i, (a, b) in enumerate(zip(LOGP, REF, strict=True)):
        inside = abs(b - a) < 20 and abs(math.exp(b - a) - (b - a) - 1) < 10
        want = 1.0 - math.exp(b - a) if inside else 0.0
        assert math.isclose(lp.grad[i].item(), want, rel_tol=1e-12, abs_tol=1e-15), i
