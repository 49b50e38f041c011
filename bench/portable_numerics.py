"""Does the demo's warm-up give the same bits on other CPUs? The same short build of the demo
recipe natively and under ``qemu-x86_64`` emulating other CPUs, with the portable-numerics
environment (:mod:`trainer_daemon.compute.portable_numerics`) and without it.

    .venv/bin/python bench/portable_numerics.py [--steps 10] [--cpus Haswell-v4,EPYC-Rome]

Prints, per environment and CPU, the SHA-256 of the weights and the build's wall time, and
whether every CPU agrees with the native build. Each CPU is a different instruction set and
vendor than the native one: qemu's Haswell is an Intel with AVX2 and FMA but no AVX-512,
EPYC-Rome an AMD with AVX2; MKL, ATen and glibc dispatch on what ``cpuid`` reports, so the
emulated runs take the code paths a real machine of that kind would. qemu computes
approximate instructions (``rsqrtps``, ``rcpps``) exactly where hardware uses vendor tables,
so a path that uses them shows up as a difference too (that is how MKL's VML square root was
found). A few steps suffice: every kernel of the build runs in each step, the other steps
repeat them. Emulation is slow: ~5 min per CPU for 10 steps on 2 cores.

Needs ``qemu-x86_64`` (Debian: ``apt-get install qemu-user``); without it only the native
builds run and the comparison is said to be missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = """
import json, sys
from pathlib import Path
from recipes.demo.warmup import WarmupRecipe, _train
fields = json.loads(sys.argv[1])
_train(WarmupRecipe(**{**fields, "tools": tuple(fields["tools"])}), Path(sys.argv[2]), lambda m: None, require_portable=False)
import torch
print(torch.backends.cpu.get_cpu_capability())
"""


def build(recipe, env: dict[str, str], cpu: str | None, work: Path) -> tuple[str, str, float]:
    """(weights' sha256 prefix, torch's CPU capability, seconds) of one build."""
    out = work / f"{cpu or 'native'}-{len(env)}"
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-c", CHILD, json.dumps(dataclasses.asdict(recipe)), str(out)]
    if cpu:
        argv = ["qemu-x86_64", "-cpu", cpu, *argv]
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"build on {cpu or 'native'} failed: {done.stderr[-2000:]}")
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()[:16]
    return digest, done.stdout.split()[-1], time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cpus", default="Haswell-v4,EPYC-Rome", help="qemu CPU models to emulate")
    ns = ap.parse_args()
    from recipes.demo.warmup import DEMO
    from trainer_daemon.compute.portable_numerics import PORTABLE_ENV, portable_environ

    recipe = dataclasses.replace(DEMO, steps=ns.steps)
    cpus = ns.cpus.split(",") if shutil.which("qemu-x86_64") else []
    free = {k: v for k, v in os.environ.items() if k not in PORTABLE_ENV}
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "?")
    print(f"native CPU: {model}; recipe {DEMO.name} cut to {ns.steps} steps; qemu CPUs: {cpus or 'none (qemu-x86_64 missing)'}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, env in (("portable", portable_environ(free)), ("free", free)):
            native, capability, seconds = build(recipe, env, None, Path(tmp))
            print(f"{label:>9} native      {capability:>8} {seconds:6.0f} s  {native}")
            for cpu in cpus:
                digest, capability, seconds = build(recipe, env, cpu, Path(tmp))
                verdict = "same bits" if digest == native else "DIFFERENT bits"
                print(f"{label:>9} {cpu:<11} {capability:>8} {seconds:6.0f} s  {digest}  {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
