"""The whole loop on real SGLang (issue 45 item 2): the demo (NATS, the rollout service, the sync
agent, the torchrun trainer) against two real CPU SGLang servers with an API key and an admin
key, weights synced over gloo, each engine behind a recording proxy.

Checked: every sync succeeds on both engines with ``/weights_checker`` asked on each (two
engines: real checksums compared); every published trajectory holds exactly the tokens,
log-probs and per-token weight versions SGLang returned (tests/helpers/engine_exactness.py),
partial rollouts included; and, in the full tier, the reward rises.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path

import pytest

from asyncrl.config import load_config
from launcher.up.report import read_jsonl
from launcher.up.stack import Stack
from tests.helpers.engine_exactness import calls_for, mismatches
from tests.helpers.recording_proxy import RecordingProxy
from tests.loop.test_modes import acked_trajectories, run_to_end
from tests.sglang.conftest import ADMIN_KEY, API_KEY, DEMO_MODEL, SLICE

DEMO = Path(__file__).resolve().parents[2] / "launcher" / "up" / "demo.toml"
RUN_LIMIT_S = 1500.0


def sync_records(run_dir: Path) -> list[dict]:
    """Every finished sync of the run, from the agent's history on disk (``/v1/syncs`` keeps the
    last 20)."""
    lines = (run_dir / "sync" / "history.jsonl").read_text().splitlines()
    return [rec for rec in map(json.loads, lines) if rec.get("event") == "finished"]


@pytest.mark.parametrize("prompts", [pytest.param(24, marks=getattr(pytest.mark, SLICE), id="slice-6-steps"),
                                     pytest.param(240, id="full-60-steps")])
@pytest.mark.timeout(RUN_LIMIT_S + 300)
async def test_the_demo_trains_on_two_real_sglang_engines(tmp_path, sglang_pair, prompts):
    proxies = [await RecordingProxy(e.url).start() for e in sglang_pair]
    cfg = load_config(DEMO, overrides=[
        f"run.dir={tmp_path / 'run'}", "run.id=sglang-loop", f"model.path={DEMO_MODEL}", "engines.backend=sglang",
        f"engines.urls={[p.url for p in proxies]!r}".replace("'", '"'), f"engines.api_key={API_KEY}",
        f"engines.admin_api_key={ADMIN_KEY}", f"rollout.total_rollout_steps={prompts}", "trainer.checkpoint.save_freq=0",
        "rollout.port=0", "sync.port=0", "trainer.metrics_port=0", f"rollout.outbox_keep_acked_s={RUN_LIMIT_S * 10}",
        "sync.check_weights=true",
    ], environ={})
    stack = Stack(cfg, tmp_path / "run")
    try:
        cfg = await run_to_end(stack, limit_s=RUN_LIMIT_S)
    finally:
        await asyncio.to_thread(stack.stop)
        for p in proxies:
            await p.stop()
    steps = prompts // cfg.actor.ppo_mini_batch_size
    rows = [r for r in read_jsonl(stack.run_dir / "metrics" / "trainer.jsonl") if "step" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))

    # every sync succeeded on both engines, and each was asked for its weights' checksum
    syncs = sync_records(stack.run_dir)
    assert len(syncs) >= steps - 1, [s["version"] for s in syncs]
    bad = [s for s in syncs if s["state"] != "succeeded" or sorted(s["engines"].values()) != ["loaded", "loaded"]]
    assert not bad, [(s["version"], s["state"], s["engines"], s["error"]) for s in bad]
    answered = []
    for p in proxies:
        checks = [(status, body) for path, status, body in p.answers if path == "/weights_checker"]
        assert len(checks) >= len(syncs), f"{p.target}: {len(checks)} weights checks for {len(syncs)} syncs"
        # each answered with a checksum (SGLang 0.5.15-0.5.22 answer 400 on a CPU: then nothing is compared)
        assert all(status == 200 and isinstance(body, dict) and body.get("per_engine_checksum") for status, body in checks), \
            [(status, str(body)[:200]) for status, body in checks if status != 200][:3]
        answered.append([body["per_engine_checksum"] for _, body in checks])
        assert any(r[1] == "/update_weights_from_distributed" for r in p.requests)
    # compared: after each sync both engines hold the same weights, so their checksums agree one for one
    assert answered[0] == answered[1], "the two engines' checksums differ after a sync"

    # every trajectory is exactly what SGLang returned
    published = acked_trajectories(stack.run_dir)
    assert len(published) == prompts * cfg.rollout.n
    exchanges = [x for p in proxies for x in p.exchanges]
    problems = {t.id: m for t in published.values() if (m := mismatches(t, calls_for(t, cfg.run.id, exchanges)))}
    if problems:  # what the engine calls of the first wrong trajectory were
        t = published[next(iter(problems))]
        calls = [(req["rid"], len(req["input_ids"]), res.output_ids, res.finish_reason.type, res.token_versions())
                 for req, res in calls_for(t, cfg.run.id, exchanges)]
        (tmp_path / "problems.json").write_text(json.dumps({"problems": problems, "calls": calls, "prompt": t.prompt_length,
                                                             "versions": t.weight_versions, "mask": t.loss_mask,
                                                             "meta": t.metadata}, default=str, indent=1))
    assert not problems, (len(problems), dict(list(problems.items())[:5]), tmp_path / "problems.json")
    versions = {v for t in published.values() for v, m in zip(t.weight_versions, t.loss_mask) if m}
    assert len(versions) > 2, f"tokens sampled under several weight versions: {versions}"

    if steps >= 40:  # the full tier: it learns (the demo: 0.26 at the start, > 0.7 by step 60 on local_engine)
        rewards = [r["critic/rewards/mean"] for r in rows]
        first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
        assert last >= first + 0.15, f"mean reward of the first 10 steps {first:.2f}, of the last 10 {last:.2f}"
