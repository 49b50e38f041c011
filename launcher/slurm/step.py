"""``python -m launcher.slurm.step [options] -- COMMAND ...``: the first thing each job step
runs on its node, before it ``exec``s the service (so srun's signals reach the service).

- ``--gpus 2,3``: the step sees only those of its node's GPUs (positions in the
  ``CUDA_VISIBLE_DEVICES`` Slurm gave the step, or GPU indices when it gave none);
  ``--gpus ''`` hides every GPU.
- ``--endpoint FILE [--port P]``: the service listens on port P (0: a port free on this node,
  found here, where it will bind); ``{port}`` in COMMAND becomes it and ``FILE`` gets
  ``{"host": ..., "port": ...}`` (written atomically) for the job driver, which cannot see
  which ports are free on another node.
- ``--node-rank-env VAR``: ``VAR`` = this task's node index in the step (``SLURM_NODEID``),
  for torchrun's ``--node-rank`` through the config's environment overrides.
- ``--id-file FILE``: write the step's id (``<job>.<step>``) to FILE, so the job driver can
  signal the step's tasks (``scancel --signal=TERM``) instead of srun, which answers a SIGTERM
  by killing its step.
- ``--secret-config KEY=VAR``: write ``{KEY: <value of $VAR>}`` to a YAML file only this user
  can read (a fresh private directory) and append ``--config FILE`` to COMMAND: SGLang reads
  its API key from a flag or from its ``--config`` file (every release asyncrl supports), and
  a flag would show the key in the command line to every user of the node. The key travels
  in the environment up to here. The file lives only until the server is up (issue 48): a
  detached watcher removes it (and its directory) once the service accepts connections on its
  port, or once the service has exited, whichever comes first; SGLang reads it while parsing
  its arguments, long before it listens. Not covered: a step killed with SIGKILL before its
  server listened leaves the file in its private directory (mode 0700) under ``$TMPDIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence

from asyncrl.files import atomic_write
from asyncrl.listen_ports import free_port


def _visible_gpus(wanted: str, inherited: str | None) -> str:
    picks = [int(x) for x in wanted.split(",") if x.strip()]
    if inherited is None:
        return ",".join(str(i) for i in picks)
    have = [x for x in inherited.split(",") if x.strip()]
    missing = [i for i in picks if i >= len(have)]
    if missing:
        raise SystemExit(f"launcher.slurm.step: GPUs {missing} asked for, but the step sees only {len(have)} "
                         f"(CUDA_VISIBLE_DEVICES={inherited})")
    return ",".join(have[i] for i in picks)


WATCH_TICK_S = 0.2


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process its parent has not reaped yet does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _remove_when_up(directory: str, port: int | None, service_pid: int) -> None:
    """Fork a detached watcher (double fork: the service never has to reap it) that removes
    ``directory`` once ``port`` accepts connections on this node or ``service_pid`` is gone."""
    if os.fork() != 0:
        os.wait()  # the intermediate child exits at once
        return
    if os.fork() != 0:
        os._exit(0)
    try:
        null = os.open(os.devnull, os.O_RDWR)  # never hold the step's output open
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stop signal to the step: outlive the service, then clean
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        while _alive(service_pid) and not (port and _listening(port)):
            time.sleep(WATCH_TICK_S)
        shutil.rmtree(directory, ignore_errors=True)
    finally:
        os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m launcher.slurm.step [options] -- COMMAND ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="launcher.slurm.step")
    p.add_argument("--gpus", default=None)
    p.add_argument("--endpoint", default=None)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--node-rank-env", default=None)
    p.add_argument("--secret-config", action="append", default=[])
    p.add_argument("--id-file", default=None)
    ns = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        print("launcher.slurm.step: no command after --", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if ns.id_file and os.environ.get("SLURM_STEP_ID"):
        atomic_write(ns.id_file, f"{os.environ.get('SLURM_JOB_ID')}.{os.environ['SLURM_STEP_ID']}")
    if ns.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = _visible_gpus(ns.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if ns.node_rank_env:
        env[ns.node_rank_env] = os.environ.get("SLURM_NODEID", "0")
    port = None
    if ns.endpoint:
        port = ns.port or free_port("0.0.0.0")  # noqa: S104 - where the service will listen
        command = [a.replace("{port}", str(port)) for a in command]
        atomic_write(ns.endpoint, json.dumps({"host": socket.gethostname(), "port": port}))
    secrets = {}
    for item in ns.secret_config:
        key, _, var = item.partition("=")
        if not env.get(var):
            print(f"launcher.slurm.step: {key} needs ${var}, which is not set", file=sys.stderr)
            return 2
        secrets[key] = env.pop(var)
    if secrets:
        path = os.path.join(tempfile.mkdtemp(prefix="asyncrl-step-"), "secrets.yaml")  # mkdtemp: mode 0700
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(secrets) + "\n")  # JSON is YAML
        command += ["--config", path]
        sys.stdout.flush()
        _remove_when_up(os.path.dirname(path), port, os.getpid())  # this pid is the service's after exec
    sys.stdout.flush()
    os.execvpe(command[0], command, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
