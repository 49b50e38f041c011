"""Rewards and trajectories an outsider shapes cannot break training (issue 30 items 5 and 6).

- A session's reward must be finite and within ``±REWARD_BOUND``, alone or as the sum of its
  components (``{a: 1e308, b: 1e308}`` summed to inf; under GRPO the group's advantages became
  NaN and the step's update was skipped, repeatably).
- The wire refuses a non-finite or huge reward, so the trainer dead-letters such a message;
  a reward function that returns one marks its own trajectory ``reward_error`` (excluded).
- The trainer dead-letters, with the reason, a trajectory of another run, one with a token
  outside the policy's vocabulary, and one longer than ``model.max_model_len``; they used to
  crash the step and be replayed after every restart. The run trains the rest and ends.
"""

from __future__ import annotations

import asyncio
import json
import math
import random

import httpx
import msgspec
import pytest

from asyncrl.config import load_config
from asyncrl.launch import free_port, log_tail
from asyncrl.wire import (
    REWARD_BOUND,
    NatsNames,
    Trajectory,
    WireDecodeError,
    decode_trajectory,
    encode_trajectory,
)
from rollout_service.agent.state import AgentState, Phase
from rollout_service.runner.finish import to_trajectory
from tests.rollout.conftest import running_service, service_config
from tests.trainer.helpers import (
    make_group,
    metrics_lines,
    publish,
    publish_raw,
    read_subject,
    start_trainer,
    wait_exit,
)
from tests.trainer.test_trainer_end_of_data import _publish_end
from trainer_daemon.audit import audit_run

API = "data-plane-token-0123456789"
N = 2


def _with_reward(traj: Trajectory, reward: float) -> bytes:
    """``traj``'s wire bytes with another reward, written past the encoder's invariants."""
    raw = msgspec.msgpack.decode(encode_trajectory(traj))
    raw["reward"] = reward
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf, 2 * REWARD_BOUND])
def test_the_wire_refuses_a_reward_that_is_not_finite_or_too_large(reward: float):
    good = make_group(random.Random(0), "g", 2)[0]
    with pytest.raises(ValueError, match="reward"):
        msgspec.structs.replace(good, reward=reward)
    with pytest.raises(WireDecodeError, match="reward"):
        decode_trajectory(_with_reward(good, reward))
    assert decode_trajectory(_with_reward(good, REWARD_BOUND)).reward == REWARD_BOUND


@pytest.mark.parametrize("reward", [math.nan, math.inf, 1e300])
def test_a_reward_function_returning_a_non_finite_reward_marks_its_own_trajectory(reward: float):
    state = AgentState(id="run-s1-0", run_id="run", group_id="s1", group_size=1, group_index=0, prompt_id="p",
                       data_source="d", token_ids=[1, 2, 3], prompt_length=2, loss_mask=[1], logprobs=[-0.5], versions=[0],
                       phase=Phase.DONE, finish_reason="stop", reward=reward)
    traj = to_trajectory(state, 0)
    assert traj.reward == 0.0 and traj.failure == "reward_error" and "reward_error" in traj.reward_details


async def test_the_session_api_refuses_rewards_that_are_not_finite_or_sum_beyond_the_bound(tmp_path, nats_server, warm_engine):
    cfg = service_config(tmp_path, nats_server.url, [warm_engine], "rollout.total_rollout_steps=1",
                         "async_training.staleness_threshold=50", f"security.api_token={API}")
    async with running_service(cfg) as (_svc, url), httpx.AsyncClient(timeout=60) as http:
        s = (await http.post(f"{url}/v1/sessions", json={}, headers={"Authorization": f"Bearer {API}"})).json()
        auth = {"Authorization": f"Bearer {s['token']}", "Content-Type": "application/json"}
        reward = f"{url}/v1/sessions/{s['id']}/reward"
        cases = [
            (b'{"components": {"a": 1e308, "b": 1e308}}', "component 'a'"),
            (b'{"components": {"a": 9e5, "b": 9e5}}', "sum to"),
            (b'{"reward": NaN}', "reward"),
            (b'{"reward": Infinity}', "reward"),
            (b'{"reward": 1e7}', "reward"),
            (b'{"components": {"\\ud800": 1}}', "surrogate"),
            (json.dumps({"components": {f"c{i}": 1 for i in range(65)}}).encode(), "components"),
        ]
        for body, fragment in cases:
            r = await http.post(reward, content=body, headers=auth)
            assert r.status_code == 400 and fragment in r.json()["error"]["message"], (body, r.status_code, r.text)
        ok = await http.post(reward, json={"components": {"a": 0.5, "b": 0.25}}, headers=auth)
        assert ok.status_code == 200, ok.text


def test_the_trainer_dead_letters_what_its_policy_cannot_train_and_goes_on(module_nats, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", f"nats.url={module_nats.url}", "run.id=admit", f"rollout.n={N}", "model.max_model_len=32",
                 "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=4", "trainer.metrics_port=0",
                 f"trainer.master_port={free_port()}", 'trainer.loggers=["jsonl"]']
    cfg = load_config(overrides=overrides, environ={})
    rng = random.Random(7)
    good = make_group(rng, "good", N)
    bad = make_group(rng, "bad", N)
    foreign = msgspec.structs.replace(bad[0], run_id="another-run")
    out_of_vocab = msgspec.structs.replace(bad[1], id="bad-vocab", token_ids=[*bad[1].token_ids[:-1], 10**6])
    too_long = msgspec.structs.replace(bad[1], id="bad-long", token_ids=[5] * 40 + bad[1].response_ids, prompt_length=40)
    nan_reward = _with_reward(msgspec.structs.replace(bad[1], id="bad-nan"), math.nan)
    publish(cfg, good)
    raw = [(encode_trajectory(msgspec.structs.replace(t, run_id="admit") if t is not foreign else t), t.id)
           for t in (foreign, out_of_vocab, too_long)]
    publish_raw(cfg, [*raw, (nan_reward, "bad-nan")])
    asyncio.run(_publish_end(cfg, samples=2, trajectories=2 * N))
    proc = start_trainer(run_dir, overrides)
    try:
        assert wait_exit(proc, 240) == 0, log_tail(run_dir / "logs" / "trainer.log")
    finally:
        proc.stop()
    lines = metrics_lines(run_dir)
    assert lines[-1]["trainer/trained_trajectories"] == N and lines[-1]["trainer/poison_messages"] == 4, lines[-1]
    reasons = sorted(m.headers["Asyncrl-Reason"] for m in read_subject(cfg, NatsNames("admit").dead_letters))
    assert len(reasons) == 4, reasons
    joined = " | ".join(reasons)
    for fragment in ("is not this run's", "outside the policy's vocabulary", "exceed model.max_model_len = 32", "reward nan"):
        assert fragment in joined, joined
    audit = asyncio.run(audit_run(run_dir, module_nats.url, "admit"))
    assert audit.ok and audit.pending == 0 and audit.poison == 4 and audit.trained == N, audit
