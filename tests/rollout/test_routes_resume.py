"""Issue 53, item 5(b): across an abort and resume with a weight update between (what a sync's
abort does), every token keeps the routes of the call that sampled or first computed it. The
turn loop drives a real ``builtin:tiny-moe`` engine (``--enable-return-routed-experts``) behind a
recording proxy: its first call is aborted mid-decode while the gate is closed, the engine
loads other weights, the resumed call asks only for the positions not held yet; the agent's
rows are exactly the first call's followed by the second's. The new weights route some of the
first call's tokens elsewhere (a fresh call over the same context says so): taking the last
call's routes for the whole prefix, as the leading implementations do, would have replaced them."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from asyncrl.chat import ChatTokenizer
from asyncrl.config.sections_core import MultiTurnConfig, SamplingConfig
from asyncrl.engine_client import EngineClient
from asyncrl.models import load_model, load_tokenizer
from asyncrl.wire.routed_experts import engine_rows
from rollout_service.agent.deps import AgentDeps
from rollout_service.agent.routes import RouteShape
from rollout_service.agent.state import AgentState, Phase
from rollout_service.agent.tool_parser import parse_hermes
from rollout_service.agent.turn import generate_turn_tokens
from tests.helpers.processes import SEED, start_engine
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.waiting import WAIT_S, wait_for
from tests.local_engine.helpers import running_tokens
from tests.rollout.test_turn_loop import Gate

MOE = "builtin:tiny-moe"
PROMPT = [5, 17, 300, 42, 8, 99, 260, 11]


class Engine:
    """The Generator of the turn loop over one engine."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def generate(self, state, input_ids, sampling_params, rid, extra=None):
        return await self.client.generate(input_ids, sampling_params, rid=rid, extra=extra, timeout_s=120)


async def test_a_resumed_call_keeps_the_routes_of_the_tokens_decoded_before_the_sync(tmp_path):
    new = load_model(MOE, dtype="float32", seed=SEED)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    new.save_pretrained(tmp_path / "new", safe_serialization=True)  # the checkpoint's names, as SGLang loads them
    shape = RouteShape.of(new.config)
    chat = ChatTokenizer(load_tokenizer(MOE))
    gate = Gate()

    async def nothing(state):
        return None

    async def reward(state):
        return 0.0, {}

    with start_engine(tmp_path, "--enable-return-routed-experts", model=MOE, name="engine-moe") as engine:
        proxy = await RecordingProxy(engine.url).start()
        try:
            async with EngineClient(proxy.url) as client, engine.client() as direct:
                deps = AgentDeps(chat=chat, generator=Engine(client), tools=None, gate=gate, parse=parse_hermes, checkpoint=nothing,
                                 reward=reward, multi_turn=MultiTurnConfig(), sampling=SamplingConfig(max_new_tokens=160),
                                 response_length=200, max_model_len=2048, rid_prefix="rl-moe.",
                                 extra_sampling={"ignore_eos": True}, routes=shape)
                state = AgentState(id="a1", run_id="r", group_id="g", group_size=1, group_index=0, prompt_id="p",
                                   data_source="d", phase=Phase.GENERATING, token_ids=list(PROMPT), prompt_length=len(PROMPT),
                                   turn_start=len(PROMPT))
                turn = asyncio.create_task(generate_turn_tokens(state, deps))
                await wait_for(lambda: _tokens_over(direct, len(PROMPT) + 12), WAIT_S, "the first call to decode")
                gate.open.clear()  # the sync's pause: the resume waits at the gate
                await direct.abort(rid="rl-moe.a1.t0.s0")  # the turn loop's rid of its first call
                await wait_for(lambda: gate.waiting.is_set(), WAIT_S, "the agent to wait at the gate")
                await direct.update_weights_from_disk(str(tmp_path / "new"), weight_version=1)
                # then the flush of the sync's abort policy: the aborted call's KV (and its routes) leave
                # the prefix cache, so the resume and the control below are computed by the new weights
                await direct.flush_cache(retries=10, interval_s=0.2)
                gate.open.set()
                ended, kept = await asyncio.wait_for(turn, 120)
                control = await direct.generate(state.token_ids[:len(PROMPT) + len(kept[0].output_ids)], {"max_new_tokens": 1},
                                                extra={"return_routed_experts": True})
        finally:
            await proxy.stop()
    assert len(kept) == 2 and kept[0].aborted and ended is False
    calls = [(req, resp) for req, resp in proxy.exchanges if req["rid"].startswith("rl-moe.")]
    (req1, res1), (req2, res2) = calls
    first = len(res1["output_ids"])
    assert req1["routed_experts_start_len"] == 0 and req2["routed_experts_start_len"] == len(PROMPT) + first - 1
    rows1 = engine_rows(res1["meta_info"]["routed_experts"], shape.layers, shape.top_k)
    rows2 = engine_rows(res2["meta_info"]["routed_experts"], shape.layers, shape.top_k)
    held = state.routed_experts.array()
    assert held.shape[0] == len(state.token_ids) - 1
    assert np.array_equal(held[: len(PROMPT) + first - 1], rows1), "the first call's tokens keep its routes"
    assert np.array_equal(held[len(PROMPT) + first - 1:], rows2)
    relooked = engine_rows(control.routed_experts, shape.layers, shape.top_k)[: len(PROMPT) + first - 1]
    assert not np.array_equal(np.sort(relooked, -1), np.sort(rows1, -1)), \
        "the new weights route some of those tokens elsewhere: the last call's routes would have replaced them"


async def _tokens_over(client, n: int) -> bool:
    return await running_tokens(client) > n
