"""Facts of every supported SGLang release read from its wheel. The torch each release pins (so its NCCL), as asyncrl's NCCL check uses it
(``asyncrl.sync_control.layout.SGLANG_TORCH_PINS``), equals the wheel's own ``Requires-Dist:
torch==`` for every release local_engine and the docs claim (issue 35 item 1: 0.5.15-0.5.17
pin 2.11.0, which the table had as 2.13.0). Downloads each wheel once (the contract kit's
cache)."""

from __future__ import annotations

import pytest

from asyncrl.sync_control.layout import SGLANG_TORCH_PINS, EngineLayout
from local_engine.compat import SUPPORTED, SglangCompat
from tests.contract.sglang_source import SUPPORTED_RELEASES as RELEASES
from tests.contract.sglang_source import behaviour_facts, requires_dist


def test_the_table_covers_exactly_the_supported_releases():
    assert SUPPORTED[0][:2] == SUPPORTED[1][:2] == (0, 5)
    assert sorted(SGLANG_TORCH_PINS) == [tuple(map(int, r.split("."))) for r in RELEASES]


@pytest.mark.parametrize("release", RELEASES)
def test_torch_pin_is_the_wheels(release):
    assert requires_dist(release, "torch") == SGLANG_TORCH_PINS[tuple(map(int, release.split(".")))]
    layout = EngineLayout(engine="e", version=release)
    assert layout.torch_pin() == requires_dist(release, "torch")


@pytest.mark.parametrize("release", RELEASES)
def test_local_engines_release_switches_are_the_wheels(release):
    """local_engine's per-release behaviour (``--sglang-compat``) where asyncrl depends on it,
    against facts read out of each release's wheel (issue 35)."""
    compat = SglangCompat.of(release)
    facts = behaviour_facts(release)
    assert {"abort_once": compat.abort_once, "weight_version_spans": compat.weight_version_spans,
            "sampling_mask": compat.sampling_mask, "sampling_mask_cap": compat.sampling_mask_cap,
            "sampling_logprobs_mode": compat.sampling_logprobs_mode} == facts


@pytest.mark.parametrize("release", RELEASES)
def test_local_engine_takes_no_sampling_key_a_release_refuses(release):
    """local_engine refuses an unknown ``sampling_params`` key (issue 35); every key it takes is
    an argument of that release's ``SamplingParams``, so none passes here and fails there."""
    from local_engine.protocol import SamplingParams
    from tests.contract.sglang_source import sampling_param_names

    assert set(SamplingParams.model_fields) <= sampling_param_names(release)
    with pytest.raises(ValueError, match="unknown sampling parameters"):
        SamplingParams.model_validate({"max_new_tokens": 2, "not_a_sampling_key": 1})
