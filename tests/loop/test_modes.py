"""verl's four modes, each run briefly through the whole real loop (NATS, a local engine, the
rollout service, the sync agent, the torchrun trainer), with their invariants checked
against the trainer's ledger and every trajectory published.

(a) on-policy pipeline: trigger 1, staleness 0; (b) stream off-policy pipeline: trigger 2,
staleness 0; (c) async stream with stale samples: staleness 0.5, no partial rollout;
(d) async stream with partial rollout: staleness 1, partial rollout.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.wire import decode_trajectory
from launcher.up.stack import Stack
from tests.helpers.waiting import wait_for
from trainer_daemon.state.checkpoint import complete_checkpoints
from trainer_daemon.state.ledger import read_lineage

MODES = {
    "a": ["async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=0"],
    "b": ["async_training.trigger_parameter_sync_step=2", "async_training.staleness_threshold=0"],
    "c": ["async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=0.5", "async_training.partial_rollout=false"],
    # Partial rollouts need a generation in flight when a sync pauses the rollout, so mode d
    # runs its engine in timing mode: long-tailed response lengths (the random tiny model
    # almost never stops early, so all generations of a batch would finish together).
    "d": ["async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1", "async_training.partial_rollout=true",
          "engines.local.timing.enabled=true", "engines.local.timing.decode_ms=20", "engines.local.timing.length_median=16",
          "engines.local.timing.length_sigma=1.5"],
}
SAMPLES = 8  # prompts; with ppo_mini_batch_size 2 → 4 trainer steps
RUN_LIMIT_S = 420.0


def mode_config(tmp_path: Path, mode: str):
    return load_config(overrides=[
        f"run.dir={tmp_path / 'run'}", f"run.id=mode-{mode}", "model.path=builtin:tiny", "model.max_model_len=512",
        "rollout.n=2", "actor.ppo_mini_batch_size=2", f"rollout.total_rollout_steps={SAMPLES}", "rollout.tools=[]",
        "rollout.sampling.max_new_tokens=64", "rollout.response_length=64", "engines.num_local=1",
        "trainer.nproc_per_node=1", "actor.ppo_micro_batch_size_per_gpu=4", "trainer.checkpoint.save_freq=0",
        "sync.pause_timeout_s=60", f"rollout.outbox_keep_acked_s={RUN_LIMIT_S * 10}", "rollout.port=0", "sync.port=0",
        "trainer.metrics_port=0", *MODES[mode],
    ], environ={})


async def run_to_end(stack: Stack, limit_s: float = RUN_LIMIT_S):
    """Start the stack and wait for the trainer to finish (a child dying first fails); the
    started config."""
    cfg = await asyncio.to_thread(stack.start, lambda m: None)

    def trainer_exited() -> bool:
        done = dict(stack.exited())
        if "trainer" in done:
            return True
        assert not done, f"a child died: {done}"
        return False

    await wait_for(trainer_exited, limit_s, "the trainer to finish its steps", interval_s=0.5)
    assert stack.children["trainer"].poll() == 0, (stack.run_dir / "logs" / "trainer.log").read_text()[-3000:]
    return cfg


async def run_mode(tmp_path: Path, mode: str):
    cfg = mode_config(tmp_path, mode)
    stack = Stack(cfg, tmp_path / "run")
    try:
        cfg = await run_to_end(stack)
    finally:
        await asyncio.to_thread(stack.stop)
    ckpts = complete_checkpoints(stack.run_dir / "checkpoints")
    assert ckpts, "the trainer saved a final checkpoint"
    lineage = read_lineage(stack.run_dir / "checkpoints", ckpts[-1][0])
    return cfg, lineage, acked_trajectories(stack.run_dir)


def rising_reward(run_dir: Path, steps: int, rise: float = 0.15) -> tuple[list[dict], float, float]:
    """The trainer's metric rows of a run of ``steps`` steps, checked: every step once, and the mean
    reward of the last 10 steps at least ``rise`` above the first 10's. Returns (rows, first, last)."""
    import statistics

    from launcher.up.report import read_jsonl

    rows = [r for r in read_jsonl(run_dir / "metrics" / "trainer.jsonl") if "step" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    rewards = [r["critic/rewards/mean"] for r in rows]
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert last >= first + rise, f"mean reward of the first 10 steps {first:.2f}, of the last 10 {last:.2f}"
    return rows, first, last


def acked_trajectories(run_dir: Path) -> dict[str, object]:
    """Every trajectory JetStream acknowledged, by id: the rollout's outbox keeps each one in
    ``acked/`` after its PubAck (``rollout.outbox_keep_acked_s``, set past the run's length).

    Read there, not from the stream: the trainer purges what it has trained at once
    (``save_freq = 0``), and a subscription lagging under load missed purged messages."""
    out: dict[str, object] = {}
    for path in sorted((run_dir / "rollout" / "outbox" / "acked").glob("*.traj")):
        t = decode_trajectory(path.read_bytes())
        out[t.id] = t
    return out


def model_versions(traj) -> list[int]:
    return [v for v, m in zip(traj.weight_versions, traj.loss_mask) if m]


def changes_within_turns(traj) -> int:
    """Version changes between adjacent model tokens of one turn (a run of loss-mask 1): each
    needs an abort and a resume. A change across tool tokens is a sync between turns."""
    pairs = zip(traj.weight_versions, traj.weight_versions[1:], traj.loss_mask, traj.loss_mask[1:])
    return sum(1 for v, w, m, n in pairs if m and n and v != w)


@pytest.mark.parametrize("mode", ["a", "b", "c", "d"])
async def test_mode_invariants(tmp_path, mode):
    cfg, lineage, published = await run_mode(tmp_path, mode)
    at = cfg.async_training
    steps = [e for e in lineage if "trained" in e and e["trained"]]
    assert [e["step"] for e in steps] == list(range(1, SAMPLES // cfg.actor.ppo_mini_batch_size + 1))
    # Step k trains the parameters after k-1 optimizer steps: weight version (k-1) // trigger.
    # (The ledger's "version" is the last sync that had *completed* at commit time; syncs run
    # in the background, so it may lag by one.)
    trigger = at.trigger_parameter_sync_step
    policy_version = {e["step"]: (e["step"] - 1) // trigger for e in steps}
    assert all(e["version"] in (policy_version[e["step"]], policy_version[e["step"]] - 1) for e in steps), steps
    bound = math.ceil(at.staleness_threshold) + (1 if at.partial_rollout and at.staleness_threshold > 0 else 0)
    missing = [i for e in steps for i in e["trained"] if i not in published]
    assert not missing, f"trained ids never seen in the stream: {missing}"
    trained = [(policy_version[e["step"]], published[i]) for e in steps for i in e["trained"]]
    for version, traj in trained:
        vs = model_versions(traj)
        assert vs and version - min(vs) <= bound, f"{traj.id}: trained at {version} with tokens from {min(vs)}"
        if mode in ("a", "b"):
            assert set(vs) == {version}, f"{traj.id}: on-policy mode trained tokens of versions {set(vs)} at {version}"
    if mode == "d":
        partial = [t for _, t in trained if len(set(model_versions(t))) > 1]
        assert partial, "partial rollouts were resumed across a sync"
        # A sync may land mid-generation (the turn is aborted and resumed) or between turns (no
        # abort needed): every version change inside a turn must have its resume.
        assert all(t.is_partial and changes_within_turns(t) <= t.metadata["resumed_after_abort"] for t in partial), \
            [(t.id, changes_within_turns(t), t.metadata["resumed_after_abort"]) for t in partial]
        from launcher.up.report import read_jsonl

        rows = read_jsonl(Path(cfg.run_dir) / "metrics" / "trainer.jsonl")
        counted = sum(r.get("fully_async/partial/total_partial_num", 0) for r in rows)
        assert counted == len(partial), f"partial counter {counted} vs {len(partial)} partial trajectories trained"
        spans = [max(model_versions(t)) - min(model_versions(t)) for t in partial]
        assert max(r.get("fully_async/partial/max_partial_span", 0) for r in rows) == max(spans)
