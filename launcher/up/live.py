"""The live view of ``asyncrl up`` and the run's metric records.

``MetricsTap`` subscribes to ``asyncrl.<run>.metrics.>`` (every component publishes verl-named
metrics there), appends every message to ``<run dir>/metrics/<component>.jsonl`` (the trainer
also writes its own ``trainer.jsonl``; the tap's copy of its messages goes to
``trainer.nats.jsonl``) and keeps the latest values per component. ``render`` draws one rich
table from them: version, step, reward, response length, samples/s, idle ratios, stale and
partial counts, the last sync, and the run's health (the rollout service's ``health`` block:
its state and, when stalled, why, naming the component to look at).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from asyncrl.wire import NatsNames


class MetricsTap:
    def __init__(self, run_id: str, run_dir: Path) -> None:
        self.names = NatsNames(run_id)
        self.dir = Path(run_dir) / "metrics"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.latest: dict[str, dict[str, Any]] = {}
        self.validation: dict[str, Any] | None = None
        self.sync: dict[str, Any] | None = None
        self.health: dict[str, Any] | None = None
        """The ``health`` block of the rollout service's ``/admin/status`` (polled by ``asyncrl up``)."""
        self._files: dict[str, Any] = {}
        self._sub = None
        self.started = time.time()
        self.first_reward: float | None = None

    async def start(self, nc) -> None:
        async def on_msg(msg) -> None:
            try:
                doc = json.loads(msg.data)
            except ValueError:
                return
            component = msg.subject.rsplit(".", 1)[-1]
            name = "trainer.nats" if component == "trainer" else component
            f = self._files.get(name) or self._files.setdefault(name, open(self.dir / f"{name}.jsonl", "a"))
            f.write(json.dumps(doc) + "\n")
            f.flush()
            if doc.get("kind") == "validation":
                self.validation = doc
                return
            metrics = doc.get("metrics", doc)
            self.latest.setdefault(component, {}).update(metrics)
            reward = metrics.get("critic/rewards/mean")
            if reward is not None and self.first_reward is None:
                self.first_reward = reward

        self._sub = await nc.subscribe(self.names.subject_prefix + ".metrics.>", cb=on_msg)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        for f in self._files.values():
            f.close()

    def value(self, component: str, key: str, default: Any = None) -> Any:
        return self.latest.get(component, {}).get(key, default)


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def health_line(health: dict[str, Any] | None) -> str | None:
    """``state`` plus, when stalled, the first reason with its component (or the first warning)."""
    if not health:
        return None
    first = (health.get("stuck") or health.get("warnings") or [None])[0]
    return health["state"] if first is None else f"{health['state']}: {first['component']}: {first['reason']}"


def render(tap: MetricsTap, run_id: str, state: str) -> Table:
    t = tap.value
    elapsed = time.time() - tap.started
    table = Table(title=f"asyncrl up · run {run_id} · {state} · {elapsed:,.0f} s", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("metric")
    table.add_column("value", justify="right")
    sync = tap.sync or {}
    last_sync = sync.get("last")
    rows = [
        ("weight version", t("trainer", "trainer/weight_version"), "trainer step", t("trainer", "trainer/global_step")),
        ("reward (mean)", t("trainer", "critic/rewards/mean"), "reward at start", tap.first_reward),
        ("response length", t("trainer", "response_length/mean"), "tokens/s (trainer)", t("trainer", "trainer/tokens_per_s")),
        ("trainer/idle_ratio", t("trainer", "trainer/idle_ratio"), "rollouter/idle_ratio", t("rollout", "rollouter/idle_ratio")),
        ("stale samples", t("trainer", "fully_async/count/stale_samples_processed"), "partial ratio", t("trainer", "fully_async/partial/partial_ratio")),
        ("trajectories finished", t("rollout", "rollout/trajectories_finished"),
         "samples/s", round(t("rollout", "count/total_generated_samples", 0) / max(elapsed, 1e-9), 3)),
        ("last sync", f"v{last_sync['version']} {last_sync['state']} {sum(last_sync['phase_seconds'].values()):.2f}s" if last_sync else None,
         "validation reward", (tap.validation or {}).get("metrics", {}).get("val-aux/reward/mean")),
    ]
    for a, av, b, bv in rows:
        table.add_row(a, _fmt(av), b, _fmt(bv))
    health = health_line(tap.health)
    if health is not None:
        table.add_row("run health", health[:120], "", "")
    return table
