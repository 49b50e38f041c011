"""The job steps of a Slurm run: one ``srun`` per service, and what each one runs.

Every step is ``srun --overlap`` (the services share the allocation's CPUs; a step without it
would wait for CPUs the trainer's step holds), one task per node, on the nodes the placement
names (``--nodelist``), with ``--container-image`` when the ``slurm`` section names one.
Its first command is :mod:`launcher.slurm.step` (GPU slice, port, node rank), which
``exec``s the service, so the signals srun forwards (SIGTERM on a stop) reach the service.
A step's output — the service's log — is ``<run dir>/logs/<name>.log``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from asyncrl.config import RunConfig, secret
from asyncrl.jetstream.embedded import find_nats_server
from asyncrl.launch import ChildProcess
from asyncrl.sync_control.pause_policy import IN_PLACE_FLAGS, plan_for
from launcher.sglang_hooks import hook_env
from launcher.slurm.placement import EngineSlot

ENGINE_KEY_ENV = "ASYNCRL_ENGINE_API_KEY"  # the SGLang keys' way to the step (see launcher.slurm.step)
ENGINE_ADMIN_KEY_ENV = "ASYNCRL_ENGINE_ADMIN_API_KEY"
NODE_RANK_ENV = "ASYNCRL_TRAINER__NODE_RANK"  # the config's environment override of trainer.node_rank


def interpreter(cfg: RunConfig) -> str:
    """The Python of every step: ``slurm.python``; else ``python3`` in a container, else this one."""
    return cfg.slurm.python or ("python3" if cfg.slurm.container_image else sys.executable)


class StepLauncher:
    """Builds and starts the ``srun`` command of each service step."""

    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.python = interpreter(cfg)

    def srun_argv(self, name: str, hosts: list[str], step_opts: list[str], command: list[str], gpus: bool) -> list[str]:
        s = self.cfg.slurm
        argv = ["srun", "--overlap", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1",
                f"--nodelist={','.join(hosts)}", f"--job-name={name}", "--kill-on-bad-exit=1", "--unbuffered"]
        if gpus and s.gpus_per_node:
            argv.append(f"--gpus-per-node={s.gpus_per_node}")
        if s.container_image:
            argv.append(f"--container-image={s.container_image}")
            if s.container_mounts:
                argv.append(f"--container-mounts={','.join(s.container_mounts)}")
        return [*argv, self.python, "-m", "launcher.slurm.step", *step_opts, "--", *command]

    def start(self, name: str, hosts: list[str], command: list[str], step_opts: list[str] | None = None,
              env: dict[str, str] | None = None, gpus: bool = False) -> ChildProcess:
        id_file = self.id_file(name)
        id_file.unlink(missing_ok=True)
        id_file.parent.mkdir(parents=True, exist_ok=True)
        argv = self.srun_argv(name, hosts, [f"--id-file={id_file}", *(step_opts or [])], command, gpus)
        child = ChildProcess(name, argv, self.run_dir / "logs" / f"{name}.log",
                             env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        return child.start()

    def id_file(self, name: str) -> Path:
        return self.run_dir / "slurm" / "steps" / f"{name}.id"

    def stop(self, name: str, child: ChildProcess, grace_s: float) -> int | None:
        """Stop a step gracefully: SIGTERM to its tasks (``scancel --signal=TERM JOB.STEP``; a
        SIGTERM to srun would make it kill the step at once), up to ``grace_s`` for them to
        exit, then srun's own termination (SIGKILL after the cluster's KillWait)."""
        if child.poll() is not None:
            return child.poll()
        id_file = self.id_file(name)
        step = id_file.read_text().strip() if id_file.exists() else None
        if step is None:
            return child.stop(grace_s=grace_s)
        subprocess.run(["scancel", "--signal=TERM", step], check=False, capture_output=True)
        try:
            return child.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return child.stop(grace_s=grace_s)

    def endpoint_file(self, name: str) -> Path:
        return self.run_dir / "slurm" / "endpoints" / f"{name}.json"


def nats_command(conf_path: Path) -> list[str]:
    return [find_nats_server(), "-c", str(conf_path)]


def engine_command(cfg: RunConfig, python: str) -> tuple[list[str], dict[str, str], list[str]]:
    """(command with ``{port}``, environment, extra step options) of one engine."""
    if cfg.engines.backend == "sglang":
        command = [python, "-m", "sglang.launch_server", "--model-path", cfg.model.path, "--host", "0.0.0.0",
                   "--port", "{port}", "--tp-size", str(cfg.engines.gpus_per_engine), "--enable-metrics",
                   *cfg.slurm.sglang_args]
        if cfg.actor.router_replay.mode == "R3" and "--enable-return-routed-experts" not in command:
            command.append("--enable-return-routed-experts")  # R3 trains on the engines' routes (issue 66 N3)
        if plan_for(cfg.sync, cfg.async_training).engine_mode == "in_place":  # issue 66 N1, N2: the sync agent requires them
            command += [flag for flag, _ in IN_PLACE_FLAGS.values() if flag not in command]
        env = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0"),
               **hook_env(cfg.engine_weight_group_timeout_s)}  # a bounded weight-group timeout (issue 66 N7)
        opts = []
        for flag, var, value in (("api-key", ENGINE_KEY_ENV, secret(cfg.engines.api_key)),
                                 ("admin-api-key", ENGINE_ADMIN_KEY_ENV, secret(cfg.engines.admin_api_key))):
            if value:
                env[var] = value
                opts.append(f"--secret-config={flag}={var}")
        return command, env, opts
    from local_engine.settings import EngineSettings  # components only lazily

    settings = EngineSettings.for_run(cfg, 1).model_copy(update={
        "host": "0.0.0.0", "api_key": secret(cfg.engines.api_key), "admin_api_key": secret(cfg.engines.admin_api_key)})
    args = settings.to_argv()
    args[args.index("--port") + 1] = "{port}"
    return [python, "-m", "launcher", "engine", *args], settings.secret_env(), []


def engine_step_opts(slot: EngineSlot, endpoint: Path, port: int) -> list[str]:
    opts = [f"--endpoint={endpoint}", f"--port={port}"]
    if slot.gpus:
        opts.append(f"--gpus={','.join(map(str, slot.gpus))}")
    return opts


def trainer_step_opts(gpus: tuple[int, ...]) -> list[str]:
    opts = [f"--node-rank-env={NODE_RANK_ENV}"]
    if gpus:
        opts.append(f"--gpus={','.join(map(str, gpus))}")
    return opts
