"""The ``asyncrl`` command line.

Subcommands import their component lazily, so ``asyncrl config show`` never imports torch.

    asyncrl config show [FILE] [section.key=value ...]   print the resolved config + derived numbers
    asyncrl nats [FILE] [k=v ...]                         run the embedded NATS JetStream server
    asyncrl engine --model M --port P                     run a local_engine (SGLang protocol, CPU)
    asyncrl rollout [FILE] [k=v ...] [--insecure-dev]     run the rollout service
    asyncrl trainer [FILE] [k=v ...]                      run the trainer under torchrun (trainer.* sets the world)
    asyncrl sync-agent [FILE] [k=v ...] [--insecure-dev]  run the sync agent
    asyncrl python-sandbox --socket PATH --owner UID      run the python tool's programs for a service (own container)
    asyncrl up [FILE] [k=v ...] [--max-minutes M]         the whole loop (no FILE: the built-in demo)
    asyncrl demo-stack [FILE] [k=v ...]                   start NATS + an engine and show them working
    asyncrl audit RUN_DIR [--nats URL] [--json]           reconcile the stream with the trainer's ledger
    asyncrl slurm [FILE] [k=v ...] [--submit]             write (and submit) a Slurm batch script for the run
    asyncrl slurm-job RUN_FILE                            the driver the batch script runs inside the allocation
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from asyncrl.files import keep_new_files_private


def _cmd_config(argv: Sequence[str]) -> int:
    from launcher.config_cli import main as config_main

    return config_main(argv)


def _cmd_nats(argv: Sequence[str]) -> int:
    from launcher.nats_cli import main as nats_main

    return nats_main(argv)


def _cmd_engine(argv: Sequence[str]) -> int:
    from local_engine.__main__ import main as engine_main

    return engine_main(argv)


def _cmd_rollout(argv: Sequence[str]) -> int:
    """The rollout service, given the demo task's files when the run has no data of its own."""
    import os

    from asyncrl.cli_args import split_config_args
    from asyncrl.config import ConfigError, load_config
    from launcher.demo_data import demo_data_env
    from rollout_service.__main__ import argument_parser
    from rollout_service.__main__ import main as rollout_main

    ns, _ = argument_parser().parse_known_args(list(argv))
    try:
        cfg = load_config(*split_config_args(ns.args))
    except ConfigError:
        cfg = None  # the service reports it
    if cfg is not None:
        os.environ.update(demo_data_env(cfg))
    return rollout_main(argv)


def _cmd_trainer(argv: Sequence[str]) -> int:
    from trainer_daemon.launch import main as trainer_main

    return trainer_main(argv)


def _cmd_sync_agent(argv: Sequence[str]) -> int:
    from sync_agent.__main__ import main as sync_main

    return sync_main(argv)


def _cmd_python_sandbox(argv: Sequence[str]) -> int:
    from tools.sandbox_server import main as sandbox_main

    return sandbox_main(argv)


def _cmd_audit(argv: Sequence[str]) -> int:
    from trainer_daemon.audit import main as audit_main

    return audit_main(argv)


def _cmd_up(argv: Sequence[str]) -> int:
    from launcher.up.main import main as up_main

    return up_main(argv)


def _cmd_slurm(argv: Sequence[str]) -> int:
    from launcher.slurm.cli import main as slurm_main

    return slurm_main(argv)


def _cmd_slurm_job(argv: Sequence[str]) -> int:
    from launcher.slurm.job import main as job_main

    return job_main(argv)


def _cmd_demo_stack(argv: Sequence[str]) -> int:
    from launcher.demo_stack import main as demo_main

    return demo_main(argv)


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "config": (_cmd_config, "show the resolved run config and verl's derived numbers"),
    "nats": (_cmd_nats, "run the embedded NATS JetStream server for a run"),
    "engine": (_cmd_engine, "run a CPU inference engine that speaks SGLang's HTTP protocol"),
    "rollout": (_cmd_rollout, "run the rollout service (agents, publisher, admin API)"),
    "trainer": (_cmd_trainer, "run the trainer daemon under torchrun (FSDP2, JetStream consumer, weight sync)"),
    "sync-agent": (_cmd_sync_agent, "run the sync agent (pause → broadcast → resume)"),
    "python-sandbox": (_cmd_python_sandbox, "run the python tool's programs on a unix socket (in a container of their own)"),
    "audit": (_cmd_audit, "reconcile the trajectory stream with the trainer's ledger: lost or trained twice?"),
    "up": (_cmd_up, "run the whole loop: NATS, engines, rollout, sync agent, trainer (no config: the demo)"),
    "slurm": (_cmd_slurm, "write (and with --submit submit) a Slurm batch script that runs the whole loop"),
    "slurm-job": (_cmd_slurm_job, "the job driver a Slurm batch script runs (starts every service as a job step)"),
    "demo-stack": (_cmd_demo_stack, "start embedded NATS and a local engine, and show them working"),
}

# Commands that write a run directory (or a NATS store): their files and their children's are
# the user's alone, umask 077 (asyncrl.files; issue 48). Not model exports: engines of other
# users (containers) read those.
WRITES_A_RUN = frozenset({"nats", "rollout", "trainer", "sync-agent", "audit", "up", "slurm", "slurm-job", "demo-stack"})


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(sorted(COMMANDS))}")
    handler, _ = COMMANDS[argv[0]]
    before = keep_new_files_private() if argv[0] in WRITES_A_RUN else None
    try:
        return int(handler(argv[1:]) or 0)
    finally:  # the children started inherited it; a caller in the same process (a test) gets its own back
        if before is not None:
            os.umask(before)


if __name__ == "__main__":
    sys.exit(main())
