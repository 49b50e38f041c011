"""The end of a run: a summary (JSON + Markdown) and a PNG plot of reward, response length,
idle ratios and staleness over training steps, from ``<run dir>/metrics/trainer.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, r in enumerate(rows):
        m = r.get("metrics", r)
        if m.get(key) is not None:
            xs.append(float(m.get("trainer/global_step", i + 1)))
            ys.append(float(m[key]))
    return xs, ys


def plot(rows: list[dict], out: Path, title: str) -> Path | None:
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("critic/rewards/mean", "mean reward"), ("response_length/mean", "response length (tokens)"),
              (("trainer/idle_ratio", "rollouter/idle_ratio"), "idle ratio"),
              (("fully_async/count/stale_samples_processed", "fully_async/partial/partial_ratio"), "staleness")]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (keys, label) in zip(axes.flat, panels):
        for key in (keys if isinstance(keys, tuple) else (keys,)):
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, label=key)
        ax.set_title(label)
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
        if isinstance(keys, tuple):
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def merge_rollout(rows: list[dict], rollout_rows: list[dict]) -> None:
    """Put the rollouter's idle ratio on the trainer step that was current when it was reported."""
    i = 0
    for r in rollout_rows:
        m, t = r.get("metrics", {}), r.get("time")
        if t is None or m.get("rollouter/idle_ratio") is None or m["rollouter/idle_ratio"] != m["rollouter/idle_ratio"]:
            continue
        while i + 1 < len(rows) and rows[i + 1].get("time", float("inf")) <= t:
            i += 1
        if rows and rows[i].get("time", float("inf")) <= t:
            rows[i]["rollouter/idle_ratio"] = m["rollouter/idle_ratio"]


def _excluded(last: dict[str, Any]) -> dict[str, int]:
    prefix = "trainer/excluded_trajectories/"
    return {k.removeprefix(prefix): int(v) for k, v in sorted(last.items()) if k.startswith(prefix) and v}


def summarize(run_dir: Path, run_id: str, reason: str, elapsed_s: float, syncs: list[dict] | None = None) -> dict[str, Any]:
    rows = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    merge_rollout(rows, read_jsonl(run_dir / "metrics" / "rollout.jsonl"))
    _, rewards = _series(rows, "critic/rewards/mean")
    k = max(1, len(rewards) // 10)
    summary = {
        "run_id": run_id, "stopped_because": reason, "elapsed_s": round(elapsed_s, 1), "trainer_steps": len(rows),
        "reward_first": round(sum(rewards[:k]) / k, 4) if rewards else None,
        "reward_last": round(sum(rewards[-k:]) / k, 4) if rewards else None,
        "syncs": int(rows[-1].get("trainer/sync_successes", 0)) if rows else 0,
        "syncs_failed": int(rows[-1].get("trainer/sync_failures", 0)) if rows else 0,
        # Trajectories never trained because an infrastructure failure spoiled them (or the
        # truncated-sampling rule dropped them), by reason: consume/exclusion.py.
        "trajectories_excluded": _excluded(rows[-1]) if rows else {},
    }
    png = plot(rows, run_dir / "summary.png", f"asyncrl run {run_id}")
    summary["plot"] = str(png) if png else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [f"# asyncrl run `{run_id}`", "", *(f"- **{k}**: {v}" for k, v in summary.items())]
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")
    return summary
