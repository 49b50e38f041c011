"""The demo task under several objectives and corrections, one `asyncrl up` run each:
final reward and wall time per variant, the default (PPO clip, GRPO, token TIS) first.

    python bench/objectives.py [--steps 120] [--variants default,gspo,cispo,rloo,icepop] [--dir runs/objectives]

Every variant is the built-in demo (``launcher/up/demo.toml``: the warmed-up ~1M-parameter
policy learning to prefer the exact calculator) with the same seed and ``--steps`` trainer
steps (``rollout.total_rollout_steps = steps × ppo_mini_batch_size``), run one after the
other on this machine. Reported per variant: reward over the first and last tenth of the
steps (the mean of ``critic/rewards/mean``), the best tenth, wall time of the RL run (from
its first to its last trainer step, the warm-up excluded: it is shared and cached), and the
exit status. One run per variant: differences smaller than the run-to-run spread of the
default (measure it with ``--variants default,default``) mean nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launcher.up.report import read_jsonl  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "default": [],
    "gspo": ["actor.loss_mode=gspo", "actor.clip_ratio_low=0.0003", "actor.clip_ratio_high=0.0004"],
    "cispo": ["actor.loss_mode=cispo", "actor.clip_ratio_high=4.0"],
    "rloo": ["actor.adv_estimator=rloo"],
    "drgrpo": ["actor.norm_adv_by_std_in_grpo=false", "actor.loss_agg_mode=seq-mean-token-sum-norm"],
    "icepop": ["actor.rollout_rs=token", "actor.rollout_rs_threshold=2.0", "actor.rollout_rs_threshold_lower=0.5",
               "actor.tis_imp_ratio_cap=null", "async_training.compute_prox_log_prob=true"],
}
MINI = 4  # the demo's actor.ppo_mini_batch_size


def tenth(values: list[float], which: str) -> float | None:
    if not values:
        return None
    k = max(1, len(values) // 10)
    if which == "first":
        part = values[:k]
    elif which == "last":
        part = values[-k:]
    else:
        return max(sum(values[i:i + k]) / k for i in range(0, len(values) - k + 1))
    return sum(part) / len(part)


def run_variant(name: str, overrides: list[str], steps: int, root: Path, max_minutes: float) -> dict:
    run_dir = root / name
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(run_dir.with_name(name + ".prev"), ignore_errors=True)
    argv = [sys.executable, "-m", "launcher", "up", "--no-live", "--max-minutes", str(max_minutes), f"run.dir={run_dir}",
            f"run.id=obj-{name}", f"rollout.total_rollout_steps={steps * MINI}", *overrides]
    t0 = time.monotonic()
    with open(root / f"{name}.log", "wb") as log:
        code = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    total = time.monotonic() - t0
    rows = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    rewards = [float(m["critic/rewards/mean"]) for r in rows if (m := r.get("metrics", r)).get("critic/rewards/mean") is not None]
    times = [float(r["time"]) for r in rows if "time" in r]
    return {"variant": name, "overrides": overrides, "exit": code, "steps": len(rows),
            "reward_first": tenth(rewards, "first"), "reward_last": tenth(rewards, "last"), "reward_best": tenth(rewards, "best"),
            "rl_wall_s": times[-1] - times[0] if len(times) > 1 else None, "total_wall_s": total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--variants", default="default,gspo,cispo")
    p.add_argument("--dir", default=str(ROOT / "runs" / "objectives"))
    p.add_argument("--max-minutes", type=float, default=30.0, help="bound of each run")
    a = p.parse_args(argv)
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for i, name in enumerate(a.variants.split(",")):
        res = run_variant(name if name not in [r["variant"] for r in results] else f"{name}{i}", VARIANTS[name], a.steps, root,
                          a.max_minutes)
        results.append(res)
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{res['variant']:>10}: exit {res['exit']}, {res['steps']} steps, reward first {fmt(res['reward_first'])} "
              f"-> last {fmt(res['reward_last'])} (best tenth {fmt(res['reward_best'])}), RL wall "
              f"{fmt(res['rl_wall_s'])} s, total {res['total_wall_s']:.0f} s", flush=True)
    (root / "objectives.json").write_text(json.dumps(results, indent=2))
    return 0 if all(r["exit"] == 0 and r["steps"] >= a.steps for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
