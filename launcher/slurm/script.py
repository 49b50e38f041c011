"""The batch script ``asyncrl slurm`` writes: ``#SBATCH`` options from the ``slurm`` section,
the user's setup lines, then ``exec python -m launcher slurm-job RUN_FILE`` — the job driver
(:mod:`launcher.slurm.job`) is the batch shell itself, so the signals Slurm sends to the
batch step (``scancel``, ``--signal=B:USR1@N`` before the time limit) reach it directly.

One task per node (``--ntasks-per-node=1``): the driver starts every service as a job step
of its own (``srun --overlap``). The job's output (the driver's account of each start and
stop) goes to ``<run dir>/logs/slurm-<job id>.out``, appended across requeues.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from asyncrl.config import RunConfig
from launcher.slurm.placement import Requirements


def job_name(cfg: RunConfig) -> str:
    return cfg.slurm.job_name or f"asyncrl-{cfg.run.id}"


def sbatch_options(cfg: RunConfig, need: Requirements, run_dir: Path) -> list[str]:
    """The ``#SBATCH`` options, in order (without the prefix)."""
    s = cfg.slurm
    opts = [f"--job-name={job_name(cfg)}", f"--nodes={s.nodes or need.nodes}", "--ntasks-per-node=1",
            f"--output={run_dir / 'logs' / 'slurm-%j.out'}", "--open-mode=append"]
    if s.gpus_per_node:
        opts.append(f"--gpus-per-node={s.gpus_per_node}")
    for key, value in (("cpus-per-task", s.cpus_per_node), ("mem", s.mem), ("partition", s.partition),
                       ("account", s.account), ("qos", s.qos), ("time", s.time)):
        if value is not None:
            opts.append(f"--{key}={value}")
    if s.exclusive:
        opts.append("--exclusive")
    opts.append("--requeue" if s.requeue else "--no-requeue")
    if s.time_limit_signal_s:
        opts.append(f"--signal=B:USR1@{s.time_limit_signal_s}")
    opts.extend(s.extra_sbatch)
    return opts


class UnsafeScriptValue(ValueError):
    """A value the batch script cannot hold safely (``#SBATCH`` lines cannot be quoted)."""


def _plain(what: str, value: str) -> str:
    """``value`` unchanged when it has no control character or whitespace, else an error: a
    newline in ``run.dir`` once injected shell lines into job.sbatch (issue 48)."""
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
        raise UnsafeScriptValue(f"{what} {value!r} contains whitespace or a control character; the batch script's "
                                "#SBATCH lines cannot quote it: choose a path without them")
    return value


def render(cfg: RunConfig, need: Requirements, run_file: Path, python: str, workdir: Path) -> str:
    """The batch script's text (raises :class:`UnsafeScriptValue` for a run directory, job name
    or interpreter path with whitespace or control characters)."""
    run_dir = Path(_plain("run.dir", str(Path(cfg.run_dir).resolve())))
    _plain("slurm.job_name", job_name(cfg))
    _plain("the python interpreter path", python)
    lines = ["#!/bin/bash", f"# asyncrl run {cfg.run.id}: written by `asyncrl slurm`; submit with `sbatch {run_dir / 'slurm' / 'job.sbatch'}`"]
    lines += [f"#SBATCH {opt}" for opt in sbatch_options(cfg, need, run_dir)]
    lines += ["set -euo pipefail", *cfg.slurm.setup, f"cd {shlex.quote(str(workdir))}",
              f"exec {shlex.quote(python)} -m launcher slurm-job {shlex.quote(str(run_file))}", ""]
    return "\n".join(lines)
