"""A mixture-of-experts model on real SGLang (issue 53): ``builtin:tiny-moe`` served by SGLang
0.5.23 started with ``--enable-return-routed-experts`` and by local_engine with the same flag
answer the same requests with the same tokens and the same routed experts, row for row (greedy,
from position 0 and from a ``routed_experts_start_len``); a weight sync in the checkpoint's
per-expert names reaches both alike; and a sync in transformers' fused in-memory names is what
SGLang skips *silently* (the update succeeds, the experts keep their old values: why the trainer
sends checkpoint names), where local_engine refuses it with a reason."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch

from asyncrl.engine_client import EngineClient
from asyncrl.models import load_model
from asyncrl.sync_control.errors import WeightSyncError
from tests.helpers.processes import start_engine
from tests.sglang.conftest import ADMIN_KEY, API_KEY
from tests.sglang_cpu.models import TINY_MOE, tiny_moe_dir
from tests.sglang_cpu.server import start_sglang
from trainer_daemon.policy.model import engine_weights
from trainer_daemon.sync.direct import DirectEnginePublisher
from trainer_daemon.sync.staging import engine_layout

TIMEOUT_S = 120.0
PROMPTS = [[31, 41, 59, 26, 53, 58, 97], [7, 7, 7, 300, 12], list(range(100, 140))]
EXPERT = "model.layers.1.mlp.experts"


async def answers(client: EngineClient) -> list[tuple[list[int], np.ndarray]]:
    """Per prompt and start length: (output ids, routes as [rows, layers, top_k])."""
    out = []
    for prompt in PROMPTS:
        for start in (None, 3):
            extra = {"return_routed_experts": True} | ({"routed_experts_start_len": start} if start is not None else {})
            res = await client._call("POST", "/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}, **extra})
            routes = np.frombuffer(base64.b64decode(res["meta_info"]["routed_experts"]), "<i4").reshape(-1, 4, 2)
            assert len(routes) == len(prompt) + 8 - 1 - (start or 0)
            out.append((res["output_ids"], routes))
    return out


def same(ours, theirs) -> None:
    for (ids_a, routes_a), (ids_b, routes_b) in zip(ours, theirs, strict=True):
        assert ids_a == ids_b
        assert np.array_equal(routes_a, routes_b)


async def test_sglang_and_local_engine_route_a_moe_model_alike_and_load_its_syncs_alike(tmp_path):
    model_dir = tiny_moe_dir()
    with start_sglang(tmp_path, model_dir, "--enable-return-routed-experts", api_key=API_KEY, admin_api_key=ADMIN_KEY,
                      name="sglang-moe") as real, \
            start_engine(tmp_path, "--enable-return-routed-experts", model=str(model_dir), api_key=API_KEY,
                         admin_api_key=ADMIN_KEY, name="local-moe") as local:
        async with real.client(request_timeout_s=TIMEOUT_S) as theirs, local.client(request_timeout_s=TIMEOUT_S) as ours:
            before = await answers(theirs)
            same(await answers(ours), before)

            trained = load_model(TINY_MOE, seed=5)  # other weights, as a trainer would have
            weights = engine_weights(dict(trained.state_dict()), tied=False, dtype=torch.float32)
            fused = {k: v for k, v in weights.items() if k.startswith(EXPERT + ".")}  # gate_up_proj, down_proj
            assert sorted(fused) == [f"{EXPERT}.down_proj", f"{EXPERT}.gate_up_proj"]
            for engine, client in ((real, theirs), (local, ours)):
                pub = DirectEnginePublisher([client], master_address="127.0.0.1", bucket_bytes=1 << 20, group_timeout_s=TIMEOUT_S,
                                            broadcast_timeout_s=TIMEOUT_S, control_timeout_s=TIMEOUT_S)
                try:
                    if engine is real:  # SGLang: "success", nothing loaded
                        await pub.publish(1, fused)
                        assert await client.weight_version() == 1
                        same(await answers(client), before)
                    else:
                        with pytest.raises(WeightSyncError, match="fused in-memory names"):
                            await pub.publish(1, fused)
                    await pub.publish(2, engine_layout(trained, tied=False).to_checkpoint(weights))
                finally:
                    await pub.close()
            after = await answers(theirs)
            assert [ids for ids, _ in after] != [ids for ids, _ in before], "the synced weights answer otherwise"
            same(await answers(ours), after)


ROUTED_PROMPT = [31, 41, 59, 26, 53, 58, 97]
ROUTED_TOKENS = 40


async def _routed_call(client, state, shape, budget: int, rid: str | None = None):
    """One call of the rollout's R3 path: routes asked from the rows the state holds, added to it."""
    from rollout_service.agent.routes import extend_routes, route_request

    res = await client.generate(state.token_ids, {"max_new_tokens": budget, "temperature": 0.0, "ignore_eos": True}, rid=rid,
                                extra=route_request(state))
    extend_routes(state, res, shape)
    state.token_ids += res.output_ids
    return res


@pytest.mark.parametrize("kind", ["local", "sglang"])
async def test_the_rollouts_routes_across_an_abort_and_a_retract_equal_an_uninterrupted_calls(tmp_path, kind):
    """Issue 66 W3, the product's R3 path (``rollout_service.agent.routes``) on each engine: a
    call aborted by its exact rid and resent (prompt + kept tokens, routes asked from the rows
    held), and a call whose engine pauses with ``retract`` (its KV freed, re-prefilled), give the
    trajectory an uninterrupted call gives — the same tokens and the same routes, row for row
    (greedy, same weights). Held mid-way with ``/slow_down`` until the abort or pause lands."""
    from transformers import AutoConfig

    from rollout_service.agent.routes import RouteShape
    from rollout_service.agent.state import AgentState
    from tests.helpers.waiting import WAIT_S, wait_for
    from tests.sglang.test_sync_policies import SLOW_S, slow_down

    model_dir = tiny_moe_dir()
    shape = RouteShape.of(AutoConfig.from_pretrained(model_dir))

    def fresh() -> AgentState:
        return AgentState(id="r3", run_id="r", group_id="g", group_size=1, group_index=0, prompt_id="p", data_source="d",
                          token_ids=list(ROUTED_PROMPT), prompt_length=len(ROUTED_PROMPT))

    start = (start_sglang(tmp_path, model_dir, "--enable-return-routed-experts", api_key=API_KEY, admin_api_key=ADMIN_KEY,
                          name="sglang-moe") if kind == "sglang" else
             start_engine(tmp_path, "--enable-return-routed-experts", model=str(model_dir), api_key=API_KEY,
                          admin_api_key=ADMIN_KEY, name="local-moe"))
    with start as engine:
        async with engine.client(request_timeout_s=TIMEOUT_S) as client:
            reference = fresh()
            await _routed_call(client, reference, shape, ROUTED_TOKENS)

            aborted = fresh()
            await slow_down(engine, SLOW_S)
            try:
                call = asyncio.create_task(_routed_call(client, aborted, shape, ROUTED_TOKENS, rid="r3-abort"))
                await wait_for(lambda: _over(engine, len(ROUTED_PROMPT) + 3), WAIT_S * 4, "the call to decode")
                await client.abort("r3-abort")
                first = await asyncio.wait_for(call, TIMEOUT_S)
            finally:
                await slow_down(engine, None)
            assert first.finish_reason.type == "abort" and 0 < len(first.output_ids) < ROUTED_TOKENS
            await _routed_call(client, aborted, shape, ROUTED_TOKENS - len(first.output_ids))

            retracted = fresh()
            await slow_down(engine, SLOW_S)
            try:
                call = asyncio.create_task(_routed_call(client, retracted, shape, ROUTED_TOKENS, rid="r3-retract"))
                await wait_for(lambda: _over(engine, len(ROUTED_PROMPT) + 3), WAIT_S * 4, "the call to decode")
                await client.pause("retract")
                await client.flush_cache(retries=3, interval_s=0.5)
            finally:
                await slow_down(engine, None)
                await client.resume()
            whole = await asyncio.wait_for(call, TIMEOUT_S)
            assert whole.meta_info["num_retractions"] == 1
    for name, state in (("abort + resend", aborted), ("retract", retracted)):
        assert state.token_ids == reference.token_ids, name
        assert state.routed_experts.num_rows == len(reference.token_ids) - 1
        assert np.array_equal(state.routed_experts.array(), reference.routed_experts.array()), f"{kind}: {name}"


async def _over(engine, n: int) -> bool:
    from tests.sglang.test_sync_policies import tokens_in_flight

    return await tokens_in_flight(engine) > n
