"""Issue 51 (first part): the per-request interrupt rule, on fixed inputs: each outcome, its
reasons, the staleness bound the trainer uses, bad settings refused naming the setting."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.sync_control.request_policy import CallFacts, RequestRule


def call(rid="r", start=4, decoded=10, remaining=90, context=500) -> CallFacts:
    return CallFacts(rid=rid, start_version=start, decoded=decoded, remaining=remaining, context=context)


def test_each_outcome_on_fixed_calls():
    rule = RequestRule(max_lag=2, keep_min_progress=0.5, resume_max_context=4096)
    assert rule.decide(call(decoded=10, remaining=90), 5)[0] == "resume"  # 10 % done: the rest on new weights
    assert rule.decide(call(decoded=90, remaining=10), 5)[0] == "keep"  # nearly done
    assert rule.decide(call(decoded=50, remaining=50), 5)[0] == "keep"  # at the threshold: kept
    assert rule.decide(call(decoded=10, remaining=90, context=5000), 5)[0] == "keep"  # too long to re-prefill
    outcome, why = rule.decide(call(start=2, decoded=90, remaining=10), 5)  # lag 3 > 2: dropped whatever it decodes
    assert outcome == "cancel" and "lag 3" in why and "2" in why
    assert rule.decide(call(start=3), 5)[0] == "resume"  # lag 2: still trainable
    assert rule.decide(call(decoded=0, remaining=0), 5)[0] == "keep"  # nothing left to decode


def test_between_syncs_a_call_already_too_stale_is_cancelled():
    rule = RequestRule(max_lag=1)
    assert rule.too_stale(call(start=3), 5) and not rule.too_stale(call(start=4), 5)


def test_the_plan_puts_every_rid_in_one_list():
    rule = RequestRule(max_lag=1)
    calls = [call("a", start=2), call("b", decoded=95, remaining=5), call("c"), call("d", start=1)]
    assert rule.plan(calls, 4) == {"cancel": ["a", "d"], "keep": ["b"], "resume": ["c"]}


PER_REQUEST = ["sync.pause_policy=per_request", "async_training.partial_rollout=true", "async_training.staleness_threshold=1.5"]


def test_only_a_drop_on_the_oldest_token_makes_a_call_certain_to_be_dropped():
    rule = RequestRule.from_config(load_config(overrides=PER_REQUEST + ["sync.per_request.keep_min_progress=0.25"]))
    assert rule.max_lag == 3 and rule.keep_min_progress == 0.25  # ceil(1.5) + 1 for partial rollout
    for extra in (["async_training.stale_policy=downweight"], ["async_training.staleness_age=token_mean"],
                  ["sync.per_request.cancel_stale=false"], ["sync.pause_policy=in_place"]):
        cfg = load_config(overrides=PER_REQUEST + extra)
        rule = RequestRule.from_config(cfg)
        assert cfg.derived.max_version_lag == 3 and rule.max_lag is None, extra
        assert rule.decide(call(start=0), 100)[0] != "cancel"


def test_config_refuses_unknown_or_out_of_range_rule_settings():
    for bad, name in (("sync.per_request.keep_min_progress=1.5", "keep_min_progress"),
                      ("sync.per_request.resume_max_context=-1", "resume_max_context"),
                      ("sync.per_request.survivor_mode=abort", "survivor_mode"),
                      ("sync.per_request.keep_progress=0.3", "keep_progress")):
        with pytest.raises(ValueError, match=name):
            load_config(overrides=PER_REQUEST + [bad])


@pytest.mark.parametrize(("kwargs", "name"), [({"max_lag": -1}, "max_lag"), ({"max_lag": 1, "keep_min_progress": 1.5}, "keep_min_progress"),
                                              ({"max_lag": 1, "resume_max_context": -3}, "resume_max_context")])
def test_bad_settings_are_refused_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RequestRule(**kwargs)


def test_a_call_expected_to_be_trained_later_is_judged_there():
    """``syncs_ahead``: the versions the trainer is expected to add while the call decodes its
    expected rest; the lag is judged at the sync's version plus those, and progress against the
    expected length, not the budget."""
    rule = RequestRule(max_lag=2, keep_min_progress=0.5)
    young_long = CallFacts(rid="r", start_version=4, decoded=50, remaining=1950, context=60, expected_remaining=900, syncs_ahead=2)
    outcome, why = rule.decide(young_long, 5)  # lag 1 at the sync, 3 when trained: dropped then
    assert outcome == "cancel" and "would lag 3" in why and "2 more versions" in why
    assert rule.decide(CallFacts(rid="r", start_version=4, decoded=50, remaining=1950, context=60, expected_remaining=900), 5)[0] == "resume"
    # 60 of an expected 100 decoded: kept, though its budget is 2000
    assert rule.decide(CallFacts(rid="r", start_version=5, decoded=60, remaining=1940, context=70, expected_remaining=40), 5)[0] == "keep"
