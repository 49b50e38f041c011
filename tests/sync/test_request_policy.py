"""Issue 51 (first part): the per-request interrupt rule, on fixed inputs: each outcome, its
reasons, the staleness bound the trainer uses, bad settings refused naming the setting."""

from __future__ import annotations

import pytest

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


def test_only_a_drop_on_the_oldest_token_makes_a_call_certain_to_be_dropped():
    assert RequestRule.for_trainer(2, "drop", "oldest").max_lag == 2
    for policy, age in (("downweight", "oldest"), ("drop", "token_mean")):
        rule = RequestRule.for_trainer(2, policy, age)
        assert rule.max_lag is None and rule.decide(call(start=0), 100)[0] != "cancel"


@pytest.mark.parametrize(("kwargs", "name"), [({"max_lag": -1}, "max_lag"), ({"max_lag": 1, "keep_min_progress": 1.5}, "keep_min_progress"),
                                              ({"max_lag": 1, "resume_max_context": -3}, "resume_max_context")])
def test_bad_settings_are_refused_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RequestRule(**kwargs)
