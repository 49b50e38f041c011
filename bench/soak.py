"""Soak: run ``asyncrl up`` for a long time and show that no process and no store grows.

    python bench/soak.py [--minutes 35] [--warm-minutes 5] [--sample-s 20] [--dir runs/soak] [overrides ...]
    python bench/soak.py --analyse --dir runs/soak [--minutes 35] [--warm-minutes 5]   # fit an earlier run again

Runs the built-in demo (``rollout.total_rollout_steps`` and ``rollout.total_epochs`` raised so
it never runs out of prompts: the demo's 2,000 prompts last ~11 minutes on two cores)
for ``--minutes``, and every ``--sample-s`` seconds samples:

- the RSS of every process of the run (nats-server, engines, rollout service, sync agent,
  torchrun and its trainer ranks), by role;
- every JetStream stream of the run's NATS server (the trajectory stream and each KV
  bucket's ``KV_*`` stream): messages and bytes;
- the run directory's durable files by kind: outbox, checkpoints, ledger, NATS store, logs,
  metrics, sync agent state.

At the end it fits a least-squares line to each series over the warm part (after
``--warm-minutes``, before the stop at ``--minutes``: samples during the shutdown show stores
emptied and processes leaving) and prints, per series, the value when warm (the baseline), the value at
the end and the slope per hour. Everything sampled goes to ``<dir>/soak.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.jetstream import connect, resolve_nats_url  # noqa: E402

ROLES = (("-m launcher up", "up"), ("-m launcher engine", "engine"), ("-m launcher rollout", "rollout"),
         ("-m launcher sync-agent", "sync_agent"), ("-m launcher trainer", "trainer_cli"), ("trainer_daemon.torchrun", "torchrun"),
         ("-m trainer_daemon", "trainer_rank"), ("nats-server", "nats"))  # first match wins
DIR_KINDS = ("rollout", "checkpoints", "nats", "logs", "metrics", "sync")


def role(p: psutil.Process) -> str | None:
    try:
        cmd = " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    for needle, name in ROLES:
        if needle in cmd:
            return name
    return None


def rss_by_role(root: psutil.Process) -> dict[str, float]:
    """MiB of RSS per role (several processes of one role: numbered)."""
    out: dict[str, float] = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        r = role(p)
        if r is None:
            continue
        try:
            mib = p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
        key, i = f"rss_mib/{r}", 0
        while key in out:
            i += 1
            key = f"rss_mib/{r}-{i}"
        out[key] = mib
    return out


def du_mib(path: Path) -> float:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total / 2**20


def dirs(run_dir: Path) -> dict[str, float]:
    out = {f"disk_mib/{k}": du_mib(run_dir / k) for k in DIR_KINDS if (run_dir / k).exists()}
    ledger = run_dir / "checkpoints" / "ledger"
    if ledger.exists():
        out["disk_mib/ledger"] = du_mib(ledger)
    return out


def nats_credentials(run_dir: Path) -> tuple[str | None, str | None]:
    """The run's NATS user and password, from the config ``asyncrl up`` wrote (None, None without)."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None, None
    doc = yaml.safe_load(path.read_text())
    return (doc.get("nats") or {}).get("user"), (doc.get("security") or {}).get("nats_password")


async def streams(url: str, run_dir: Path) -> dict[str, float]:
    user, password = nats_credentials(run_dir)
    nc = await connect(url, "soak", user=user, password=password, persistent=False)
    try:
        jsm = nc.jsm()
        out = {}
        for info in await jsm.streams_info():
            out[f"stream_msgs/{info.config.name}"] = float(info.state.messages)
            out[f"stream_mib/{info.config.name}"] = info.state.bytes / 2**20
        return out
    finally:
        await nc.close()


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var == 0 else sum((t - mt) * (v - mv) for t, v in points) / var * 3600.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=35.0)
    ap.add_argument("--warm-minutes", type=float, default=5.0)
    ap.add_argument("--sample-s", type=float, default=20.0)
    ap.add_argument("--dir", default="runs/soak")
    ap.add_argument("--analyse", action="store_true", help="only fit and print <dir>/soak.json of an earlier run")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    run_dir = Path(a.dir).resolve()
    if a.analyse:
        return report(json.loads((run_dir / "soak.json").read_text()), a.warm_minutes * 60, a.minutes * 60, a.sample_s)
    argv = [sys.executable, "-m", "launcher", "up", "--no-live", "--max-minutes", str(a.minutes), f"run.dir={run_dir}",
            "rollout.total_rollout_steps=10000000", "rollout.total_epochs=100000", *a.overrides]
    print("running:", " ".join(argv), flush=True)
    up = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = psutil.Process(up.pid)
    samples: list[dict[str, float]] = []
    start = time.monotonic()
    try:
        while up.poll() is None:
            time.sleep(a.sample_s)
            row = {"t_s": time.monotonic() - start, **rss_by_role(root), **dirs(run_dir)}
            try:
                row.update(asyncio.run(streams(resolve_nats_url(None, run_dir), run_dir)))
            except Exception as exc:  # noqa: BLE001 - NATS not up yet, or gone at the end
                row["nats_error"] = 1.0
                print(f"  (no stream sample: {exc})", flush=True)
            samples.append(row)
            if len(samples) % 6 == 0:
                print(f"  {row['t_s'] / 60:5.1f} min: {len(row)} series sampled", flush=True)
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(120)
    (run_dir / "soak.json").write_text(json.dumps(samples))
    return report(samples, a.warm_minutes * 60, a.minutes * 60, a.sample_s)


def report(samples: list[dict[str, float]], warm_s: float, stop_s: float, sample_s: float) -> int:
    """Fit and print each series over the warm samples taken before the run's stop began at
    ``stop_s`` (samples during the shutdown show stores emptied and processes leaving)."""
    warm = [s for s in samples if warm_s <= s["t_s"] < stop_s and "nats_error" not in s]
    if len(warm) < 3:
        print("too few warm samples to fit a slope", file=sys.stderr)
        return 1
    keys = sorted({k for s in warm for k in s if k not in ("t_s", "nats_error")})
    hours = (warm[-1]["t_s"] - warm[0]["t_s"]) / 3600
    print(f"\nasyncrl up for {samples[-1]['t_s'] / 60:.1f} min; fit over the warm {hours * 60:.1f} min before the stop "
          f"({len(warm)} samples every {sample_s:.0f} s)")
    print(f"{'series':<44}{'warm':>12}{'end':>12}{'slope/h':>12}")
    for k in keys:
        pts = [(s["t_s"], s[k]) for s in warm if k in s]
        if len(pts) < 3:
            continue
        print(f"{k:<44}{pts[0][1]:>12.2f}{pts[-1][1]:>12.2f}{slope_per_hour(pts):>12.2f}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
