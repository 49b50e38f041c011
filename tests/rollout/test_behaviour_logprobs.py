"""Truncated sampling with exact behaviour log-probs (issue 35): the rollout service's own agents
sample with ``top_k``; where the engine's release has sampling masks (SGLang 0.5.16+) every call
asks for them, and the published trajectory carries each model token's log-prob under the
truncated distribution it was drawn from (``behaviour_logprobs``, its spans flagged), next to
the untruncated ``rollout_logprobs``. Both are checked against the same model's teacher-forced
logits. An engine emulating 0.5.15 is never asked: its trajectories are marked uncorrected.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.models import load_model
from tests.helpers.processes import start_engine
from tests.helpers.recording_proxy import RecordingProxy
from tests.rollout.conftest import running_service, service_config
from tests.rollout.test_service_episodes import fetch_all

TOP_K, TEMPERATURE = 20, 0.8
SAMPLING = (f"rollout.sampling.top_k={TOP_K}", f"rollout.sampling.temperature={TEMPERATURE}", "rollout.sampling.max_new_tokens=24",
            "rollout.response_length=64", "rollout.total_rollout_steps=2", "rollout.n=2", "async_training.staleness_threshold=50")


async def _trajectories(tmp_path, nats_url, engine_url):
    proxy = await RecordingProxy(engine_url).start()
    try:
        async with running_service(service_config(tmp_path, nats_url, [proxy.url], *SAMPLING)):
            trajs = await fetch_all(nats_url, "demo", 4)
    finally:
        await proxy.stop()
    asked = [bool(req.get("return_sampling_mask")) for req, _ in proxy.exchanges if req.get("rid", "").startswith("rl-")]
    return trajs, asked


async def test_trajectories_carry_the_truncated_distributions_logprobs(tmp_path, nats_server, warm_engine, warm_model):
    trajs, asked = await _trajectories(tmp_path, nats_server.url, warm_engine)
    assert asked and all(asked), "every agent call samples with top_k: each asks for the sampling mask"
    model = load_model(str(warm_model), dtype="float32")
    for t in trajs:
        assert all(s.truncated and s.behaviour_logprobs for s in t.sampling) and not t.truncation_uncorrected
        assert len(t.behaviour_logprobs) == len(t.rollout_logprobs) == t.response_length
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([t.token_ids])).logits[0].double() / TEMPERATURE
        for i, (m, lp, blp) in enumerate(zip(t.loss_mask, t.rollout_logprobs, t.behaviour_logprobs, strict=True)):
            if not m:
                assert blp == lp == 0.0
                continue
            row, token = logits[t.prompt_length + i - 1], t.token_ids[t.prompt_length + i]
            full = torch.log_softmax(row, -1)
            top = torch.topk(full, TOP_K).indices
            assert token in top.tolist()
            truncated = full[token] - torch.logsumexp(full[top], -1)
            assert lp == pytest.approx(float(full[token]), abs=1e-4)
            assert blp == pytest.approx(float(truncated), abs=1e-4)
            assert blp >= lp - 1e-6  # renormalised over the kept mass (equal where it holds all of it)
        assert t.behaviour_logprob_list() == t.behaviour_logprobs


async def test_an_engine_without_masks_is_not_asked_and_the_trajectory_says_uncorrected(tmp_path, nats_server, warm_model):
    with start_engine(tmp_path, "--sglang-compat", "0.5.15", model=str(warm_model), name="engine-0.5.15") as engine:
        trajs, asked = await _trajectories(tmp_path, nats_server.url, engine.url)
    assert asked and not any(asked)
    for t in trajs:
        assert t.behaviour_logprobs == [] and t.truncation_uncorrected and t.behaviour_logprob_list() == t.rollout_logprobs
        assert all(s.truncated and not s.behaviour_logprobs for s in t.sampling)
