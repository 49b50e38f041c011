"""Issue 52, "it learns": an OpenAI Agents SDK agent, unmodified (``examples/agents_sdk_agent.py``:
the SDK's default Responses model on session base URLs, the demo's two tools run by the agent
itself), is the run's only source of data (``data.source = "sessions"``): the demo's starting
policy, trained on its episodes for 60 steps, prefers the exact tool and its reward rises, as
the demo's own agents make it rise (0.26 at the start, > 0.7 by step 60 on local_engine).
Every trained trajectory is a session's. The ``./dev test-agents`` tier (~5 minutes)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from asyncrl.config import load_config, secret
from launcher.up.stack import Stack
from tests.loop.test_modes import acked_trajectories, rising_reward

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "launcher" / "up" / "demo.toml"
DEMO_MODEL = ROOT / "asyncrl" / "models" / "assets" / "tiny-arith"  # the demo's starting policy, shipped
STEPS = 60
RUN_LIMIT_S = 1500.0


def example():
    spec = importlib.util.spec_from_file_location("agents_sdk_agent", ROOT / "examples" / "agents_sdk_agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(RUN_LIMIT_S + 300)
async def test_an_agents_sdk_agent_trained_through_sessions_learns(tmp_path):
    agent = example()
    cfg = load_config(DEMO, overrides=[
        f"run.dir={tmp_path / 'run'}", "run.id=agents-sdk", f"model.path={DEMO_MODEL}", "data.source=sessions", f"trainer.total_training_steps={STEPS}",
        "trainer.checkpoint.save_freq=0", "rollout.port=0", "sync.port=0", "trainer.metrics_port=0",
        f"rollout.outbox_keep_acked_s={RUN_LIMIT_S * 10}",
    ], environ={})
    stack = Stack(cfg, tmp_path / "run")
    stop = asyncio.Event()
    try:
        cfg = await asyncio.to_thread(stack.start, lambda m: None)
        token = secret(cfg.security.api_token) if cfg.security.api_token else None
        rows = agent.demo_rows(seed=0)
        players = asyncio.create_task(agent.play(stack.urls["rollout"], token, rows, n=cfg.rollout.n, groups_at_once=6,
                                                 max_groups=None, max_tokens=cfg.rollout.sampling.max_new_tokens, stop=stop))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RUN_LIMIT_S
        while "trainer" not in dict(stack.exited()):
            assert not stack.exited(), f"a child died: {stack.exited()}"
            assert not players.done() or players.exception() is None, players.exception()
            assert loop.time() < deadline, "the trainer did not finish its steps in time"
            await asyncio.sleep(0.5)
        assert stack.children["trainer"].poll() == 0, (stack.run_dir / "logs" / "trainer.log").read_text()[-3000:]
        stop.set()
        groups = await asyncio.wait_for(players, 300)
    finally:
        stop.set()
        await asyncio.to_thread(stack.stop)
    rising_reward(stack.run_dir, STEPS)
    published = acked_trajectories(stack.run_dir)
    assert len(published) >= STEPS * cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    assert all(t.metadata.get("session") for t in published.values()), "every trajectory is a session's"
    assert all(t.group_id.startswith("x:") for t in published.values())
    assert sum(len(g) for g in groups) >= len(published), "the driver played every published episode"
