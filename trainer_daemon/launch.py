"""``asyncrl trainer [CONFIG] [section.key=value ...]``: start the trainer under torchrun.

Builds, prints and executes (``os.execv``: signals reach torchrun directly)::

    python -m trainer_daemon.torchrun --nnodes N --nproc-per-node P --node-rank R \\
        --master-addr A --master-port PORT --rdzv-backend static --max-restarts 0 \\
        -m trainer_daemon [CONFIG] [section.key=value ...]

from ``trainer.nnodes``, ``nproc_per_node``, ``node_rank``, ``master_addr``, ``master_port``
(0 picks a free port on a single node; multi-node needs an explicit one). On CPU it sets
``OMP_NUM_THREADS`` to the cores per rank unless already set. ``trainer_daemon.torchrun`` is
torchrun with its store bound to 127.0.0.1 for loopback master addresses.

For clusters, run torchrun yourself on every node: ``torchrun --nnodes ... -m trainer_daemon CONFIG``.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence

from asyncrl.launch import free_port


def torchrun_argv(trainer, args: Sequence[str]) -> list[str]:
    """The command line (module docstring) for the ``trainer`` section, the user's ``args`` passed through."""
    t = trainer
    port = t.master_port
    if port == 0:
        if t.nnodes > 1:
            raise ValueError("trainer.master_port=0 (pick a free port) only works on one node; set a port")
        port = free_port(t.master_addr if t.master_addr != "localhost" else "127.0.0.1")
    return [
        sys.executable, "-m", "trainer_daemon.torchrun",
        "--nnodes", str(t.nnodes), "--nproc-per-node", str(t.nproc_per_node), "--node-rank", str(t.node_rank),
        "--master-addr", t.master_addr, "--master-port", str(port), "--rdzv-backend", "static", "--max-restarts", "0",
        "-m", "trainer_daemon", *args,
    ]


def main(argv: Sequence[str]) -> int:
    from asyncrl.cli_args import split_config_args as _split_config_args
    from asyncrl.config import load_config
    from asyncrl.files import private_dir

    args = list(argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    path, overrides = _split_config_args(args)
    cfg = load_config(path, overrides)  # fail here, once, on a bad config
    cmd = torchrun_argv(cfg.trainer, args)
    private_dir(cfg.run_dir)  # checkpoints, the ledger and metrics are the user's alone (issue 48)
    if cfg.trainer.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.trainer.nproc_per_node))
    print("+ " + shlex.join(cmd), flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached
