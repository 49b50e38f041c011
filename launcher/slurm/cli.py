"""``asyncrl slurm [FILE] [section.key=value ...] [--submit]``: a Slurm batch script for the run.

Checks that the allocation the ``slurm`` section asks for can hold the placement (refused,
exit 2, with both numbers, before anything is written), then writes into ``<run dir>/slurm/``:

- ``run.yaml`` — the resolved config the job reads (mode 0600: it may hold configured secrets);
- ``job.sbatch`` — the batch script (:mod:`launcher.slurm.script`).

With ``--submit`` it runs ``sbatch`` on the script and prints the job id. Submitting again with
the same ``run.dir`` resumes the run (newest checkpoint, the outbox and the stream on disk).
Watch a run with ``squeue``, ``<run dir>/logs/`` and the health views (``/admin/status`` of the
rollout service, ``/status`` of the sync agent, at the addresses in ``<run dir>/config.yaml``);
``asyncrl audit <run dir>`` after it ends.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from asyncrl.cli_args import split_config_args
from asyncrl.config import ConfigError, load_config, revealed_document
from asyncrl.files import write_private
from launcher.slurm.placement import PlacementError, requirements
from launcher.slurm.script import UnsafeScriptValue, render
from launcher.slurm.steps import interpreter


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl slurm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", help="[CONFIG_FILE] [section.key=value ...]")
    parser.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    ns = parser.parse_args(argv)
    path, overrides = split_config_args(ns.args)
    try:
        cfg = load_config(path, overrides)
        need = requirements(cfg)
    except (ConfigError, PlacementError) as exc:
        print(f"asyncrl slurm: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir).resolve()
    doc = revealed_document(cfg)
    doc["run"]["dir"] = str(run_dir)
    run_file = run_dir / "slurm" / "run.yaml"
    script = run_dir / "slurm" / "job.sbatch"
    try:
        text = render(cfg, need, run_file, interpreter(cfg), Path.cwd())
    except UnsafeScriptValue as exc:  # before anything is written
        print(f"asyncrl slurm: {exc}", file=sys.stderr)
        return 2
    # the run directory and its logs are the user's alone (engines' and services' logs, the
    # job's output): 0700 where asyncrl creates them (issue 48)
    for d in (run_dir, run_dir / "slurm", run_dir / "logs"):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(run_file, yaml.safe_dump(doc, sort_keys=False))
    script.write_text(text)  # Slurm opens the job's output file in logs/ before the script runs
    script.chmod(0o700)
    print(f"wrote {script} ({need.nodes} node(s), {need.engines} engine(s), "
          f"{need.gpus_per_node} GPU(s) on the busiest node) and {run_file}")
    if not ns.submit:
        print(f"submit with: sbatch {script}")
        return 0
    try:
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        print("asyncrl slurm: sbatch not found: run --submit on a Slurm login node", file=sys.stderr)
        return 1
    if out.returncode != 0:
        print(f"asyncrl slurm: sbatch refused the job (exit {out.returncode}): {out.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = out.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}; output {run_dir / 'logs' / f'slurm-{job_id}.out'}; "
          f"stop with `scancel {job_id}` (a checkpoint is written), resume by submitting again")
    return 0
