"""The one turn loop (rollout_service.agent.turn) driven by scripted engines: a streamed
OpenAI turn survives an engine failure the way a non-streamed one does, continuing after
the tokens the client has already been sent; only when the retries run out does the stream
carry an error. OpenAI turns never checkpoint into the agents bucket."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.chat import ChatTokenizer
from asyncrl.config.sections_core import MultiTurnConfig, SamplingConfig
from asyncrl.engine_client.errors import EngineHTTPError, EngineUnavailable
from asyncrl.engine_client.types import GenerateResult
from asyncrl.models import load_tokenizer
from rollout_service.agent import turn as turn_mod
from rollout_service.agent.deps import AgentDeps
from rollout_service.agent.state import AgentState, Phase
from rollout_service.agent.tool_parser import parse_hermes
from rollout_service.agent.turn import generate_turn_tokens
from rollout_service.openai.streaming import stream_turn
from rollout_service.openai.turns import TurnSpec, run_turn

WAIT_S = 10.0  # bound on every wait in this file; the fakes answer at once
ANSWER = "The answer is 42, computed with care."


def _result(ids: list[int], lps: list[float], finish: dict | None) -> GenerateResult:
    return GenerateResult.parse({"text": "", "output_ids": ids, "meta_info": {
        "id": "r", "finish_reason": finish, "weight_version": "0", "completion_tokens": len(ids),
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}})


class ScriptedEngines:
    """A Generator whose calls follow a script: each entry is ``(tokens, fail)`` — the call
    produces ``tokens`` (cumulatively, one token per streamed chunk), then fails with
    EngineUnavailable when ``fail``, else finishes (``stop`` on EOS, else ``length``)."""

    def __init__(self, script: list[tuple[list[int], bool]], eos: int) -> None:
        self.script, self.eos = list(script), eos
        self.calls: list[dict] = []

    def _next(self, state, input_ids, rid, stream: bool):
        self.calls.append({"input_ids": list(input_ids), "rid": rid, "engine_id": state.engine_id, "stream": stream})
        state.engine_id = "e-1"
        ids, fail = self.script.pop(0)
        return ids, fail, [-0.01 * (len(input_ids) + i) for i in range(len(ids))]

    def _finish(self, ids):
        return {"type": "stop", "matched": self.eos} if ids and ids[-1] == self.eos else {"type": "length", "length": len(ids)}

    async def generate(self, state, input_ids, sampling_params, rid, extra=None):
        ids, fail, lps = self._next(state, input_ids, rid, stream=False)
        if fail:
            raise EngineUnavailable("connection refused (scripted)")
        return _result(ids, lps, self._finish(ids))

    async def generate_stream(self, state, input_ids, sampling_params, rid, extra=None):
        ids, fail, lps = self._next(state, input_ids, rid, stream=True)
        for n in range(1, len(ids) + 1):
            last = n == len(ids) and not fail
            yield _result(ids[:n], lps[:n], self._finish(ids) if last else None)
        if fail:
            raise EngineUnavailable("connection dropped mid-stream (scripted)")


class Gate:
    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.waiting = asyncio.Event()

    @property
    def paused(self) -> bool:
        return not self.open.is_set()

    async def wait_open(self) -> None:
        if self.paused:
            self.waiting.set()
        await self.open.wait()


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer(load_tokenizer("builtin:tiny"))


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(turn_mod, "ENGINE_RETRY_BACKOFF_S", 0.0)


def _deps(chat, engines, gate=None, checkpoints=None) -> AgentDeps:
    async def checkpoint(state):
        (checkpoints if checkpoints is not None else []).append(list(state.token_ids))

    async def reward(state):
        return 0.0, {}

    return AgentDeps(chat=chat, generator=engines, tools=None, gate=gate or Gate(), parse=parse_hermes, checkpoint=checkpoint,
                     reward=reward, multi_turn=MultiTurnConfig(), sampling=SamplingConfig(),
                     response_length=512, max_model_len=2048, rid_prefix="rl-test.")


def _state(chat) -> AgentState:
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    ids = chat.prompt_ids(messages)
    return AgentState(id="api-1", run_id="r", group_id="api", group_size=1, group_index=0, prompt_id="api", data_source="api",
                      messages=messages, phase=Phase.GENERATING, token_ids=list(ids), prompt_length=len(ids), turn_start=len(ids))


SPEC = TurnSpec(temperature=1.0, top_p=1.0, max_new_tokens=64, tool_choice="none")


async def _stream(chat, state, deps, want_logprobs=False) -> tuple[list[dict], list]:
    outcomes = []

    async def on_done(out):
        outcomes.append(out)

    body = stream_turn(state, deps, chat, SPEC, 2048, model="m", want_logprobs=want_logprobs, include_usage=False, on_done=on_done)
    raw = await asyncio.wait_for(_collect(body), WAIT_S)
    events = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    assert raw.endswith(b"data: [DONE]\n\n")
    return events, outcomes


async def _collect(body) -> bytes:
    return b"".join([piece async for piece in body])


async def test_a_streamed_turn_survives_an_engine_failure_like_a_non_streamed_one(chat):
    answer = chat.encode_text(ANSWER) + [chat.eos_token_id]
    cut = 4

    # non-streamed: the first call fails, the retry answers the whole turn
    plain = ScriptedEngines([(answer, True), (answer, False)], chat.eos_token_id)
    state = _state(chat)
    out = await asyncio.wait_for(run_turn(state, _deps(chat, plain), chat, SPEC, 2048), WAIT_S)
    assert out.finish_reason == "stop" and out.content == ANSWER and out.model_ids == answer
    assert len(plain.calls) == 2 and plain.calls[1]["engine_id"] is None, "the retry lets the router pick another engine"

    # streamed: the stream breaks after `cut` tokens (the client has seen them); the retry continues after them
    streamed = ScriptedEngines([(answer[:cut], True), (answer[cut:], False)], chat.eos_token_id)
    state = _state(chat)
    prompt = list(state.token_ids)
    events, outcomes = await _stream(chat, state, _deps(chat, streamed), want_logprobs=True)
    assert not [e for e in events if "error" in e], events
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert finishes == ["stop"]
    streamed_lps = [c["logprob"] for e in events if e.get("choices") and e["choices"][0]["logprobs"]
                    for c in e["choices"][0]["logprobs"]["content"]]
    [done] = outcomes
    assert done.finish_reason == "stop" and done.content == ANSWER and done.model_ids == answer
    assert streamed_lps == done.model_logprobs, "every kept token's logprob was streamed exactly once"
    assert [c["stream"] for c in streamed.calls] == [True, True]
    assert streamed.calls[1]["input_ids"] == prompt + answer[:cut], "the retry continues from the tokens already sent"
    assert streamed.calls[0]["rid"].endswith(".t0.s0") and streamed.calls[1]["rid"].endswith(".t0.s1")
    assert streamed.calls[1]["engine_id"] is None
    assert state.token_ids == prompt + answer and state.loss_mask == [1] * len(answer)


async def test_a_streamed_turn_reports_an_error_only_when_the_retries_run_out(chat):
    answer = chat.encode_text(ANSWER)
    engines = ScriptedEngines([(answer[:2], True)] + [([], True)] * (turn_mod.ENGINE_RETRIES - 1), chat.eos_token_id)
    state = _state(chat)
    events, outcomes = await _stream(chat, state, _deps(chat, engines))
    assert len(engines.calls) == turn_mod.ENGINE_RETRIES
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == 502 and "scripted" in errors[0]["message"]
    assert outcomes[0].finish_reason == "error" and outcomes[0].model_ids == answer[:2], "tokens already sent are kept"
    finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert finishes == [], "the error event ends the stream: no finish_reason outside OpenAI's values"


async def test_an_engine_4xx_is_never_retried(chat):
    class Refusing(ScriptedEngines):
        async def generate(self, state, input_ids, sampling_params, rid, extra=None):
            self.calls.append({"rid": rid})
            raise EngineHTTPError(400, "input_ids is empty (scripted)")

    engines = Refusing([], chat.eos_token_id)
    state = _state(chat)
    ended, kept = await asyncio.wait_for(generate_turn_tokens(state, _deps(chat, engines)), WAIT_S)
    assert ended is None and kept == [] and len(engines.calls) == 1, "a deterministic refusal is not retried"
    assert state.finish_reason == "error" and state.reward_details["engine_status"] == 400
    assert state.failure == "engine_error", "an engine failure is never a learning signal"


async def test_sampling_spans_follow_the_parameters_each_call_sent(chat):
    """A turn at T=0.7 (cut by a pause and resumed with the same parameters: one span), tool
    tokens, then a turn at T=1.0 with top_p 0.9 (a new span at its first model token)."""
    answer = chat.encode_text(ANSWER) + [chat.eos_token_id]
    gate = Gate()

    class PausingOnce(ScriptedEngines):
        async def generate(self, state, input_ids, sampling_params, rid, extra=None):
            self.sent.append(dict(sampling_params))
            if len(self.calls) == 0:
                self._next(state, input_ids, rid, stream=False)
                gate.open.clear()
                asyncio.get_running_loop().call_later(0.01, gate.open.set)
                return _result(answer[:3], [-0.5] * 3, {"type": "abort", "message": "paused"})
            return await super().generate(state, input_ids, sampling_params, rid, extra)

    engines = PausingOnce([(answer[:3], False), (answer[3:], False), (answer, False)], chat.eos_token_id)
    engines.sent = []
    state = _state(chat)
    deps = _deps(chat, engines, gate)
    deps.sampling = SamplingConfig(temperature=0.7)
    await asyncio.wait_for(generate_turn_tokens(state, deps), WAIT_S)
    env = chat.environment_segment([{"role": "user", "content": "again"}])
    state.token_ids += env
    state.loss_mask += [0] * len(env)
    state.logprobs += [0.0] * len(env)
    state.versions += [-1] * len(env)
    state.assistant_turns, state.turn_start = 1, len(state.token_ids)
    second = state.response_length
    deps.sampling = SamplingConfig(temperature=1.0, top_p=0.9)
    await asyncio.wait_for(generate_turn_tokens(state, deps), WAIT_S)
    assert [p["temperature"] for p in engines.sent] == [0.7, 0.7, 1.0]
    assert [(s.start, s.temperature, s.top_p, s.top_k) for s in state.sampling] == [(0, 0.7, 1.0, -1), (second, 1.0, 0.9, -1)]


async def test_openai_turns_continue_after_a_pause_without_checkpointing_but_agents_checkpoint(chat):
    answer = chat.encode_text(ANSWER) + [chat.eos_token_id]

    class PausingEngines(ScriptedEngines):
        """The first call is aborted by a pause (the gate closes) after 3 tokens."""

        async def generate(self, state, input_ids, sampling_params, rid, extra=None):
            if not self.calls:
                self._next(state, input_ids, rid, stream=False)
                gate.open.clear()
                return _result(answer[:3], [-0.5] * 3, {"type": "abort", "message": "paused"})
            return await super().generate(state, input_ids, sampling_params, rid, extra)

    for name, run in (("openai turn", lambda s, d: run_turn(s, d, chat, SPEC, 2048)), ("agent", generate_turn_tokens)):
        gate, checkpoints = Gate(), []
        engines = PausingEngines([(answer[:3], False), (answer[3:], False)], chat.eos_token_id)
        state = _state(chat)
        prompt = list(state.token_ids)
        task = asyncio.create_task(run(state, _deps(chat, engines, gate, checkpoints)))
        await asyncio.wait_for(gate.waiting.wait(), WAIT_S)
        if name == "agent":
            assert checkpoints == [prompt + answer[:3]], "an internal agent parks its partial turn in its checkpoint"
        else:
            assert checkpoints == [], "an OpenAI turn is not an internal agent: it never enters the agents bucket"
        gate.open.set()
        await asyncio.wait_for(task, WAIT_S)
        assert state.token_ids == prompt + answer and state.resumed_after_abort == 1, name
        assert engines.calls[1]["input_ids"] == prompt + answer[:3] and engines.calls[1]["rid"].endswith(".s1"), name


async def test_an_unmet_tool_choice_fails_explicitly_streamed_or_not(chat):
    """tool_choice named: the model ends the turn inside the forced call (EOS at once). OpenAI
    promises a call, so the outcome is an error (422 tool_choice_not_satisfied), and a stream
    carries it as its error event instead of a finish chunk."""
    spec = TurnSpec(temperature=1.0, top_p=1.0, max_new_tokens=16, tool_choice={"type": "function", "function": {"name": "calc"}})
    state = _state(chat)
    out = await asyncio.wait_for(run_turn(state, _deps(chat, ScriptedEngines([([chat.eos_token_id], False)], chat.eos_token_id)),
                                          chat, spec, 2048), WAIT_S)
    assert out.finish_reason == "error" and out.error.status == 422 and out.error.code == "tool_choice_not_satisfied"
    outcomes = []

    async def on_done(o):
        outcomes.append(o)

    body = stream_turn(_state(chat), _deps(chat, ScriptedEngines([([chat.eos_token_id], False)], chat.eos_token_id)), chat, spec,
                       2048, model="m", want_logprobs=False, include_usage=False, on_done=on_done)
    raw = await asyncio.wait_for(_collect(body), WAIT_S)
    events = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == "tool_choice_not_satisfied" and errors[0]["param"] == "tool_choice"
    assert not [e for e in events if e.get("choices") and e["choices"][0].get("finish_reason")]
    assert outcomes[0].finish_reason == "error"


async def test_a_call_cancelled_while_in_flight_ends_the_agent_as_stale_cancelled(chat):
    """Issue 51: a per-request pause marks the agent (``state.cancelled``) and aborts its call;
    when the aborted result comes back the agent ends, never resent: its trajectory is marked
    ``stale_cancelled`` (never trained) with the tokens it had, and no reward is asked."""
    answer = chat.encode_text(ANSWER)

    class CancelledMidCall(ScriptedEngines):
        async def generate(self, state, input_ids, sampling_params, rid, extra=None):
            self.calls.append({"rid": rid})
            state.cancelled = "its oldest token (version 0) would lag 3 versions at 3, beyond the trainer's 2"
            return _result(answer[:3], [-0.1] * 3, {"type": "abort", "message": "Aborted"})

    engines = CancelledMidCall([], chat.eos_token_id)
    state = _state(chat)
    ended, kept = await asyncio.wait_for(generate_turn_tokens(state, _deps(chat, engines)), WAIT_S)
    assert ended is None and len(kept) == 1 and len(engines.calls) == 1, "a cancelled call is not resent"
    assert state.phase == Phase.DONE and state.finish_reason == "abort" and state.failure == "stale_cancelled"
    assert state.token_ids[state.prompt_length:] == answer[:3] and "lag 3" in state.reward_details["cancelled"]


async def test_between_syncs_an_agent_already_too_stale_makes_no_call(chat):
    """Issue 51, item 3: before each generate call ``deps.stale_check`` is asked; an agent the
    trainer would certainly drop is cancelled without decoding another token."""
    from asyncrl.sync_control.request_policy import RequestRule
    from rollout_service.runner.per_request import stale_reason

    rule = RequestRule(max_lag=2)
    engines = ScriptedEngines([(chat.encode_text(ANSWER) + [chat.eos_token_id], False)], chat.eos_token_id)
    served = {"version": 4}
    deps = _deps(chat, engines)
    deps.stale_check = lambda state, budget: stale_reason(rule, state, served["version"])
    fresh = _state(chat)
    fresh.version_start = 2  # lag 2 at version 4: still trainable
    ended, _ = await asyncio.wait_for(generate_turn_tokens(fresh, deps), WAIT_S)
    assert ended is True and len(engines.calls) == 1
    old = _state(chat)
    old.version_start = 1  # lag 3 > 2: the trainer would drop it
    ended, kept = await asyncio.wait_for(generate_turn_tokens(old, deps), WAIT_S)
    assert ended is None and kept == [] and len(engines.calls) == 1, "no call for a trajectory already too stale"
    assert old.failure == "stale_cancelled" and "lags 3" not in old.cancelled and "would lag 3" in old.cancelled
    assert stale_reason(rule, _state(chat), 100) == "", "no token yet: nothing to judge"
