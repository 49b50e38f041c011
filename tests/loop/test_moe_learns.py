"""Issue 53 (c): a mixture-of-experts policy learns through the whole real loop with routing
replay on. ``builtin:tiny-moe`` warmed up on the demo task as the demo's own policy is
(``recipes.demo.warmup.MOE_DEMO``: built once, cached), then the demo run (NATS, a local engine
returning routed experts, the rollout service, the sync agent, the torchrun trainer) with
``actor.router_replay.mode = "R3"`` for 60 steps: the mean reward of the last 10 steps is above
the first 10's, every trained trajectory carries one route row per position, weight syncs reach
the engine in the checkpoint's per-expert names (samples of later versions exist), and the
trainer reports its flip rate. And on that trained policy (issue 53, 5a), the engine in bf16 and
the trainer in fp32: replaying the engine's routes makes the log-prob gap of the tokens after a
flipped route at least 10x smaller (on the random-init model flips move log-probs too little
for that: tests/local_engine/test_routes_bf16_replay.py). The ``./dev test-moe`` tier (the
warm-up ~10 min once, then ~4 min)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.models.builtin import TINY_LAYERS
from asyncrl.models.builtin_moe import TINY_MOE_TOP_K
from launcher.up.stack import Stack
from recipes.demo.warmup import MOE_DEMO, warm_up
from tests.loop.test_modes import acked_trajectories, model_versions, rising_reward, run_to_end

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "launcher" / "up" / "demo.toml"
STEPS = 60
RUN_LIMIT_S = 1500.0


@pytest.mark.timeout(RUN_LIMIT_S + 1200)
async def test_a_moe_policy_learns_the_demo_with_routing_replay(tmp_path):
    import asyncio

    policy = await asyncio.to_thread(warm_up, MOE_DEMO, lambda m: None)
    cfg = load_config(DEMO, overrides=[
        f"run.dir={tmp_path / 'run'}", "run.id=moe-demo", f"model.path={policy}", "actor.router_replay.mode=R3",
        f"trainer.total_training_steps={STEPS}", "trainer.checkpoint.save_freq=0", "rollout.port=0", "sync.port=0",
        "trainer.metrics_port=0", f"rollout.outbox_keep_acked_s={RUN_LIMIT_S * 10}",
    ], environ={})
    stack = Stack(cfg, tmp_path / "run")
    try:
        cfg = await run_to_end(stack, RUN_LIMIT_S)
    finally:
        await asyncio.to_thread(stack.stop)
    rows, first, last = rising_reward(stack.run_dir, STEPS)
    assert all("actor/router_replay/flip_rate" in r for r in rows)
    flips = statistics.mean(r["actor/router_replay/flip_rate"] for r in rows)
    print(f"tiny-moe with R3: reward {first:.2f} (steps 1-10) -> {last:.2f} (steps {STEPS - 9}-{STEPS}); mean flip rate {flips:.4f}")
    published = list(acked_trajectories(stack.run_dir).values())
    assert len(published) >= STEPS * cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    for t in published:
        routes = t.routed_experts
        assert routes is not None and (routes.layers, routes.top_k) == (TINY_LAYERS, TINY_MOE_TOP_K), t.id
        assert routes.num_rows == len(t.token_ids) - 1, t.id
    newest = max(max(model_versions(t), default=0) for t in published)
    assert newest >= STEPS // 2, f"the engine served weights of version {newest} at most: the syncs did not land"


async def test_replay_cuts_the_bf16_mismatch_tenfold_on_the_trained_moe_policy(tmp_path):
    import asyncio

    from tests.local_engine.test_routes_bf16_replay import bf16_replay_gaps, prompts

    policy = await asyncio.to_thread(warm_up, MOE_DEMO, lambda m: None)
    g = await bf16_replay_gaps(str(policy), tmp_path, prompt_ids=prompts(64))
    print(g.line())
    assert g.flips > 0
    assert g.live >= 10 * g.replayed, g.line()
