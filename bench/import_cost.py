"""What loading the control plane's apps costs: the rollout service and the sync agent.

Run: ``.venv/bin/python bench/import_cost.py [--reps 5]``

Each measurement is a fresh interpreter that imports one app (``rollout_service.app``,
``sync_agent.app``) and reports the import's wall time and the process's peak RSS. The
baseline, in the same run, is the same import after ``import torch`` (what the apps cost
while ``asyncrl.weight_sync`` loaded torch for them, before the torch-free
``asyncrl.sync_control`` split: issue 34 item 2). Median of ``--reps`` runs; prints one table.
Not covered: the services' own start-up after the import (config, NATS, the tokenizer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APPS = ("rollout_service.app", "sync_agent.app")
CHILD = """
import importlib, json, resource, sys, time
t0 = time.perf_counter()
if sys.argv[2] == "1":
    import torch  # noqa: F401
importlib.import_module(sys.argv[1])
print(json.dumps({"s": time.perf_counter() - t0, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "torch": "torch" in sys.modules}))
"""


def measure(app: str, with_torch: bool, reps: int) -> dict:
    runs = []
    for _ in range(reps):
        out = subprocess.run([sys.executable, "-c", CHILD, app, "1" if with_torch else "0"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=300)
        runs.append(json.loads(out.stdout))
    return {"s": statistics.median(r["s"] for r in runs), "rss_mib": statistics.median(r["rss_mib"] for r in runs),
            "torch": runs[0]["torch"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(f"{'app':22} {'import s':>9} {'peak RSS MiB':>13} {'torch loaded':>13}   baseline (torch loaded too): s, MiB")
    for app in APPS:
        now, base = measure(app, False, args.reps), measure(app, True, args.reps)
        print(f"{app:22} {now['s']:9.2f} {now['rss_mib']:13.0f} {str(now['torch']):>13}   {base['s']:.2f} s, {base['rss_mib']:.0f} MiB"
              f"  ({base['s'] / now['s']:.1f}x time, {base['rss_mib'] - now['rss_mib']:.0f} MiB more)")


if __name__ == "__main__":
    main()
