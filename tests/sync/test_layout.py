"""Engine layouts from /server_info: rank offsets, layouts SGLang cannot update, NCCL pins."""

from __future__ import annotations

import pytest

from asyncrl.sync_control.layout import (
    SGLANG_TORCH_PINS,
    EngineLayout,
    LayoutError,
    assign_ranks,
    check_nccl,
    parse_version,
)


def layout(engine="e", **info) -> EngineLayout:
    return EngineLayout.from_server_info(engine, {"version": "0.5.23", **info})


def test_rank_offsets_follow_each_engines_tp_size():
    offsets, world = assign_ranks([layout("a", tp_size=2), layout("b"), layout("c", tp_size=4)])
    assert offsets == [1, 3, 4] and world == 8


@pytest.mark.parametrize(("info", "needle"), [
    ({"pp_size": 2}, "pp_size=2"),
    ({"dp_size": 2}, "dp_size=2; sglang 0.5.23 asserts dp_size == 1"),
    ({"dp_size": 2, "enable_dp_attention": True}, "dp_size=2; sglang 0.5.23 asserts"),
    ({"dp_size": 2, "version": "0.5.21"}, "without --enable-dp-attention"),
    ({"dp_size": 2, "version": "dev-build"}, "(unknown version)"),
    ({"tp_size": 0}, "tp_size=0 is not a positive integer"),
    ({"tp_size": "2"}, "tp_size='2' is not a positive integer"),
])
def test_layouts_sglang_cannot_update_are_refused_naming_engine_and_setting(info, needle):
    with pytest.raises(LayoutError) as err:
        assign_ranks([layout("http://gpu-3:30000", **info)])
    assert "engine http://gpu-3:30000" in str(err.value) and needle in str(err.value)


def test_older_releases_accept_dp_with_dp_attention():
    offsets, world = assign_ranks([layout(dp_size=2, enable_dp_attention=True, version="0.5.18", tp_size=2)])
    assert offsets == [1] and world == 3


def test_nccl_versions_compared_directly_or_through_the_releases_torch_pin():
    assert parse_version("0.5.23.post2") == (0, 5, 23) and parse_version("main") is None
    assert SGLANG_TORCH_PINS[(0, 5, 18)] == "2.13.0" and SGLANG_TORCH_PINS[(0, 5, 23)] == "2.14.1"
    reported = layout("local", nccl_version="2.27.3")
    assert check_nccl([reported], "2.27.3", "2.13.0") == []
    assert "runs NCCL 2.27.3, the trainer NCCL 2.28.1" in check_nccl([reported], "2.28.1", "2.14.1")[0]
    assert check_nccl([layout("new")], "2.27.3", "2.14.1+cu128") == []
    problems = check_nccl([layout("new"), layout("old", version="0.5.18")], "2.27.3", "2.14.1+cu128")
    assert len(problems) == 1 and "engine old runs sglang 0.5.18, which pins torch 2.13.0" in problems[0]
    assert "build the trainer image with torch==2.13.0" in problems[0]
    assert check_nccl([layout("x", version="0.6.0")], None, "2.14.1") == []  # unknown pin: nothing to compare


def test_retract_and_in_place_are_refused_on_releases_without_spans():
    """Issue 35 item 3: a request kept across a sync (retract, in_place) holds tokens of two
    versions, which only the engines' weight_versions spans tell apart (sglang 0.5.19+,
    tests/contract/test_release_facts.py); the sync agent refuses such a group (409
    pause_policy) and the direct publisher fails the sync, naming engine and release."""
    from asyncrl.sync_control.pause_policy import pause_plan, policy_problems

    old, new, unknown = (EngineLayout(engine=e, version=v) for e, v in (("old", "0.5.18"), ("new", "0.5.21"), ("x", None)))
    for policy in ("retract", "in_place"):
        problems = policy_problems(pause_plan(policy, True), [old, new, unknown])
        assert len(problems) == 1 and "engine old runs sglang 0.5.18" in problems[0] and f"pause_policy={policy}" in problems[0]
    assert policy_problems(pause_plan("abort", True), [old]) == []
    # issue 46 item 11: retract also needs 0.5.21's flush of a paused engine's queue; in_place does not
    mid = [EngineLayout(engine=f"e{v}", version=v) for v in ("0.5.19", "0.5.20")]
    problems = policy_problems(pause_plan("retract", True), [*mid, new])
    assert len(problems) == 2 and all("cannot flush the prompt cache" in p and "pause_policy=abort" in p for p in problems)
    assert policy_problems(pause_plan("in_place", True), mid) == []
    assert policy_problems(pause_plan("retract", False), [old]) == [], "no partial rollout: the sync drains, nothing is kept"
