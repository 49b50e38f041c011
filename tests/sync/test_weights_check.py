"""After an update the engines must hold the same weights (issue 35): SGLang's
``/weights_checker`` on every member, asked by :meth:`EngineUpdate.check_weights`
(asyncrl/sync_control/weights_check.py), here against real local_engines serving it.

Engines A and B hold the same weights, C other ones (another seed), D C's weights on two
emulated tensor-parallel ranks (another layout: its checksum cannot be compared with the
others'). The rules: a strict majority of one layout is right and the rest are mixed (the
update goes on without them); no majority makes every member of that layout mixed and fails the
update; an engine alone in its layout is not judged.
"""

from __future__ import annotations

import hashlib

import aiohttp
import pytest

from asyncrl.engine_client import WeightsCheck
from asyncrl.sync_control.engine_update import EngineUpdate, Member
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.sync_control.weights_check import disagreeing
from tests.helpers.processes import start_engine


def test_the_majority_of_a_layout_is_right_and_a_tie_convicts_everyone():
    a, b, c = WeightsCheck("a" * 64, 1), WeightsCheck("b" * 64, 1), WeightsCheck("c" * 64, 1)
    assert disagreeing({"e1": a, "e2": a, "e3": a}).all == {}
    v = disagreeing({"e1": a, "e2": a, "e3": b})
    assert list(v.minority) == ["e3"] and v.undecided == {}
    assert "differ from 2 of the 3 engines" in v.minority["e3"]
    v = disagreeing({"e1": a, "e2": b})  # nothing says which is right
    assert sorted(v.undecided) == ["e1", "e2"] and v.minority == {}
    assert sorted(disagreeing({"e1": a, "e2": a, "e3": b, "e4": b, "e5": c}).undecided) == ["e1", "e2", "e3", "e4", "e5"]
    v = disagreeing({"e1": a, "e2": a, "tp2": WeightsCheck("d" * 64, 2)})  # alone in its layout
    assert v.all == {} and list(v.not_judged) == ["tp2"]
    assert disagreeing({"e1": a}).all == {}


def test_engines_of_different_releases_are_never_compared():
    """Issue 46 item 2: the releases hash different sets of tensors, so identical weights on
    0.5.20 and 0.5.21 need not give one checksum. Two engines, one per release: neither is
    judged (before: every sync failed, undecided); three: the odd release is not quarantined
    (before: outvoted, mixed) while a real minority within a release still is."""
    a, b, c = WeightsCheck("a" * 64, 1), WeightsCheck("b" * 64, 1), WeightsCheck("c" * 64, 1)
    v = disagreeing({"old": a, "new": b}, {"old": "0.5.20", "new": "0.5.21"})
    assert v.all == {} and sorted(v.not_judged) == ["new", "old"]
    v = disagreeing({"n1": b, "n2": b, "old": a}, {"n1": "0.5.21", "n2": "0.5.21", "old": "0.5.20"})
    assert v.all == {} and list(v.not_judged) == ["old"]
    v = disagreeing({"n1": b, "n2": b, "n3": c, "old": a}, {"n1": "0.5.21", "n2": "0.5.21", "n3": "0.5.21", "old": "0.5.20"})
    assert list(v.minority) == ["n3"] and "sglang 0.5.21" in v.minority["n3"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    logs = tmp_path_factory.mktemp("weights-check")
    with start_engine(logs, name="wc-a") as a, start_engine(logs, name="wc-b") as b, \
            start_engine(logs, "--seed", "7", name="wc-c") as c, \
            start_engine(logs, "--seed", "7", "--tp-size", "2", "--sglang-compat", "0.5.20", name="wc-d") as d:
        yield {"a": a, "b": b, "c": c, "d": d}


async def post(engine, body) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(f"{engine.url}/weights_checker", json=body) as r:
        return r.status, await r.json()


async def test_the_route_answers_sglangs_shape(engines):
    status, body = await post(engines["a"], {"action": "checksum"})
    assert status == 200 and body["success"] and body["message"] == "Success."
    (rank,) = body["ranks"]
    assert body["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
    assert rank["parallelism_info"]["role"] == "target" and rank["parallelism_info"]["size"] == 1
    names = set(rank["checksums"])
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: once
    _, skipped = await post(engines["a"], {"skip_tensor_list": ["embed_tokens"]})  # the action defaults to checksum
    assert set(skipped["ranks"][0]["checksums"]) == names - {"model.embed_tokens.weight"}
    assert skipped["per_engine_checksum"] != body["per_engine_checksum"]
    _, same = await post(engines["b"], {"action": "checksum", "unknown_field": 1})  # ignored, as SGLang's models do
    assert same["per_engine_checksum"] == body["per_engine_checksum"]
    _, d = await post(engines["d"], {})
    assert [r["parallelism_info"]["tp_rank"] for r in d["ranks"]] == [0, 1] and "role" not in d["ranks"][0]["parallelism_info"]
    for bad, why in (({"action": "compare"}, "Unsupported action"), ({"action": None}, "action"),
                     ({"allow_quant_error": "yes"}, "allow_quant_error")):
        status, body = await post(engines["a"], bad)
        assert status == 400 and why in str(body), (bad, body)


def loaded(engines, ids) -> EngineUpdate:
    members = [Member(i, engines[i].client(), sent=1, confirmed=1) for i in ids]
    update = EngineUpdate(members, control_timeout_s=30, total_buckets=1)
    update.buckets = 1
    return update


async def check(update: EngineUpdate) -> tuple[dict[str, str] | None, WeightSyncError | None]:
    try:
        return await update.check_weights(), None
    except WeightSyncError as exc:
        return None, exc
    finally:
        for m in update.members:
            await m.client.close()


async def test_engines_that_agree_pass_and_an_outvoted_one_is_mixed_without_failing_the_update(engines):
    update = loaded(engines, ["a", "b", "d"])  # d is alone in its layout
    assert await check(update) == ({}, None)
    assert {update.outcome(m) for m in update.members} == {"loaded"}
    update = loaded(engines, ["a", "b", "c"])
    outvoted, err = await check(update)
    assert err is None and list(outvoted) == ["c"]  # the majority serves on; the caller takes c out
    assert {m.id: update.outcome(m) for m in update.members} == {"a": "loaded", "b": "loaded", "c": "mixed"}


async def test_two_engines_that_disagree_fail_the_update_and_are_both_mixed(engines):
    update = loaded(engines, ["a", "c"])
    _, err = await check(update)
    assert err is not None and "a:" in str(err) and "c:" in str(err)
    assert {update.outcome(m) for m in update.members} == {"mixed"}


async def test_a_member_that_did_not_load_everything_is_not_asked(engines):
    update = loaded(engines, ["a", "b", "c"])
    update.members[2].confirmed = 0  # c failed a bucket: mixed already, not compared
    assert await check(update) == ({}, None)
    assert update.outcome(update.members[2]) == "mixed"


async def test_the_agent_quarantines_an_outvoted_engine_and_the_sync_succeeds(tmp_path, nats_server):
    """Three engines of one kind, one of which silently nudges what it loads (failpoint
    ``local_engine.weights_drift``): after a full push its weights differ from the two others'.
    The sync succeeds at the new version on the two; the third is quarantined before the rollout
    resumes and marked for reload. (An engine of another dtype is not outvoted: its checksum is
    not comparable, issue 66 N9.)"""
    from asyncrl import failpoints
    from tests.sync.conftest import ENGINE_ARGS, perturbed_weights, publisher, stack
    from tests.sync.test_sync_agent import engine_logprobs

    logs = tmp_path / "logs"
    points = tmp_path / "drift"
    points.mkdir()
    (points / "local_engine.weights_drift.arm").touch()
    with start_engine(logs, *ENGINE_ARGS, name="agree-0") as e0, start_engine(logs, *ENGINE_ARGS, name="agree-1") as e1, \
            start_engine(logs, *ENGINE_ARGS, env={failpoints.ENV_DIR: str(points)}, name="outvoted") as odd:
        async with stack(tmp_path, nats_server.url, [e0.url, e1.url, odd.url]) as (svc, _rollout_url, agent, agent_url, cfg):
            pub = publisher(agent_url, cfg, bucket_bytes=512 * 1024)
            try:
                _, weights = perturbed_weights(3)
                await pub.publish(1, weights)  # returns only when the agent reports "succeeded"
                rec = agent.coordinator.records[-1]
                views = {e.url: e for e in (await agent.coordinator.rollout.status()).engines}
                ids = {url: views[url].id for url in (e0.url, e1.url, odd.url)}
                assert rec.state == "succeeded"
                assert rec.engines == {ids[e0.url]: "loaded", ids[e1.url]: "loaded", ids[odd.url]: "mixed"}
                assert ids[odd.url] in agent.coordinator.needs_reload
                assert views[odd.url].state == "quarantined" and views[e0.url].state != "quarantined"
                assert svc.runner.version == 1 and not svc.runner.paused
                for url in (e0.url, e1.url):
                    assert (await engine_logprobs(url, 2))[2] == 1
            finally:
                await pub.close()


def test_local_engine_skips_the_buffers_each_release_skips():
    """Issue 46 item 2: local_engine's checksum leaves out the names SGLang's weight checker of
    the emulated release takes for non-persistent buffers (its patterns, read from the wheels)."""
    from local_engine.weights import skipped_as_buffer

    assert skipped_as_buffer("model.rotary_emb.inv_freq", "0.5.15") and skipped_as_buffer("model.rotary_emb.inv_freq", "0.5.23")
    assert skipped_as_buffer("mlp.gate._weight_fp32", "0.5.18") and not skipped_as_buffer("mlp.gate._weight_fp32", "0.5.19")
    assert not skipped_as_buffer("experts.expert_mask_gpu", "0.5.17") and skipped_as_buffer("experts.expert_mask_gpu", "0.5.18")
    assert not skipped_as_buffer("attn.rotary.cos_cache", "0.5.19") and skipped_as_buffer("attn.rotary.cos_cache", "0.5.20")
    assert not skipped_as_buffer("model.layers.0.self_attn.q_proj.weight", "0.5.23")


def test_engines_that_hash_other_tensors_or_bytes_are_never_compared():
    """Issue 66 N9: besides the release, expert parallelism, the dtype, a quantization and a draft
    model change what ``/weights_checker`` hashes (other shards, other bytes, more tensors), so
    engines differing in any of them are in groups of their own, read from ``/server_info``."""
    from asyncrl.sync_control.layout import EngineLayout

    base = {"version": "0.5.23", "tp_size": 1, "ep_size": 1, "dtype": "auto", "quantization": None,
            "speculative_draft_model_path": None}
    kinds = {name: EngineLayout.from_server_info(name, {**base, **extra}).weights_kind for name, extra in (
        ("plain", {}), ("same", {"dtype": "auto"}), ("ep2", {"ep_size": 2}), ("bf16", {"dtype": "bfloat16"}),
        ("fp8", {"quantization": "fp8"}), ("draft", {"speculative_draft_model_path": "/m/draft"}))}
    assert kinds["plain"] == kinds["same"] == "sglang 0.5.23"
    assert len({kinds[k] for k in ("plain", "ep2", "bf16", "fp8", "draft")}) == 5, kinds
    a, b = WeightsCheck("a" * 64, 1), WeightsCheck("b" * 64, 1)
    v = disagreeing({"plain": a, "same": a, "bf16": b, "fp8": b}, kinds)
    assert v.all == {} and sorted(v.not_judged) == ["bf16", "fp8"]
    assert "dtype bfloat16" in v.not_judged["bf16"]
    v = disagreeing({"plain": a, "same": b}, kinds)  # the same kind still disagrees
    assert sorted(v.undecided) == ["plain", "same"]
