"""Partial rollout with adapter syncs (issue 36 item 4), deterministically: a sync meets an
assistant turn mid-generation, and the turn resumes on the new adapter.

The turn runs through the product's turn loop (``generate_turn_tokens``) with the rollout
service's own dependencies (its engine pool, pause gate and adapter route), against a LoRA
engine behind a recording proxy (``lora_engine``: local_engine here, real SGLang in
tests/sglang/test_lora.py). The engine is slowed down (SGLang's ``/slow_down``: every forward
sleeps) before the turn starts and given its speed back only once the sync's pause has reached
it, so the sync always meets the turn in flight however loaded the machine.

Checked: the turn lost no token and was resumed once; the resumed call asked for adapter v2 by
``lora_path``; the tokens before the sync carry version 1 and those after it version 2; and each
part's log-probs are what peft's forward of its adapter gives on the whole sequence (the tail was
re-prefilled and decoded on v2, not on v1 or the base).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rollout_service.agent.state import AgentState, Phase
from rollout_service.agent.turn import generate_turn_tokens
from tests.helpers.processes import start_engine
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.reference_model import teacher_forced_logprobs
from tests.helpers.waiting import WAIT_S, wait_for
from tests.sync.conftest import (
    ENGINE_ARGS,
    engine_tokens_over,
    service_idle,
    slow_down,
    stack,
    sync_through_a_slowed_engine,
)
from tests.sync.test_adapter_sync import LORA, RUN_ID, adapter_publisher, snapshots

PROMPT = [5, 17, 42, 99, 7, 300, 12]
LONG = 600  # the turn's budget: slowed down, it cannot end before the sync met it
BEFORE_HOLD = 10  # tokens decoded on adapter v1 before the sync
SLOW_S = 0.25  # each forward's sleep while slowed: 600 tokens would take 150 s
CALL_S = 300.0


@pytest.fixture
def lora_engine(tmp_path):
    with start_engine(tmp_path, *ENGINE_ARGS, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj",
                      "v_proj", name="lora-engine") as engine:
        yield engine


async def test_a_sync_meets_a_turn_in_flight_and_the_turn_resumes_on_the_new_adapter(tmp_path, nats_server, lora_engine):
    (v1_model, v1), (v2_model, v2) = snapshots(tmp_path, 2)
    engine = lora_engine
    proxy = await RecordingProxy(engine.url).start()
    try:
        async with stack(tmp_path, nats_server.url, [proxy.url], *LORA, "async_training.partial_rollout=true",
                         "sync.pause_policy=abort", "rollout.total_rollout_steps=1", "rollout.n=1",
                         f"model.max_model_len={len(PROMPT) + LONG + 8}") as (svc, _, agent, agent_url, cfg):
            await wait_for(lambda: service_idle(svc, engine), WAIT_S, "the service's own sample to finish")
            pub = adapter_publisher(agent_url, cfg, tmp_path)
            try:
                await pub.publish(1, v1)
                await wait_for(lambda: svc.runner.version == 1 and not svc.runner.paused, WAIT_S, "the rollout at v1")
                state, deps = _turn(svc, cfg)
                await slow_down(engine, SLOW_S)
                turn = asyncio.create_task(generate_turn_tokens(state, deps))
                await wait_for(lambda: engine_tokens_over(engine, len(PROMPT) + BEFORE_HOLD), WAIT_S * 4, "the turn to decode")
                await sync_through_a_slowed_engine(engine, proxy, pub.publish(2, v2))
                ended, kept = await asyncio.wait_for(turn, CALL_S)
            finally:
                await pub.close()
            assert agent.coordinator.records[-1].state == "succeeded"
    finally:
        await proxy.stop()
    out = state.token_ids[len(PROMPT):]
    assert ended is False and len(out) == LONG, "the turn ran to its budget: no token lost"
    assert state.resumed_after_abort == 1 and len(kept) == 2 and kept[0].aborted
    first = len(kept[0].output_ids)
    assert BEFORE_HOLD <= first < LONG
    assert state.versions == [1] * first + [2] * (LONG - first)
    asked = [(req["rid"], req.get("lora_path")) for req, _ in proxy.exchanges if req.get("rid", "").startswith(deps.rid_prefix + state.id)]
    assert [lora for _, lora in asked] == [f"{RUN_ID}-v1", f"{RUN_ID}-v2"], asked
    assert asked[1][0].endswith(".s1")
    want_v1 = teacher_forced_logprobs(v1_model, PROMPT, out[:first])
    want_v2 = teacher_forced_logprobs(v2_model, PROMPT, out)[first:]
    assert state.logprobs[:first] == pytest.approx(want_v1, abs=1e-4)
    assert state.logprobs[first:] == pytest.approx(want_v2, abs=1e-4)


def _turn(svc, cfg) -> tuple[AgentState, object]:
    """An agent state holding ``PROMPT`` and the service's dependencies for a greedy turn of
    ``LONG`` tokens that never stops at EOS (no checkpoint store: this agent is not the runner's)."""
    async def no_checkpoint(state) -> None:
        return None

    sampling = cfg.rollout.sampling.model_copy(update={"max_new_tokens": LONG, "temperature": 0.0})
    deps = dataclasses.replace(svc.runner.deps, sampling=sampling, response_length=LONG, checkpoint=no_checkpoint,
                               extra_sampling={"ignore_eos": True})
    state = AgentState(id="resume-on-v2", run_id=RUN_ID, group_id="g", group_size=1, group_index=0, prompt_id="p",
                       data_source="test", phase=Phase.GENERATING, token_ids=list(PROMPT), prompt_length=len(PROMPT),
                       turn_start=len(PROMPT))
    return state, deps
