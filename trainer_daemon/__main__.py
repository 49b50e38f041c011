"""``torchrun [torchrun options] -m trainer_daemon [CONFIG] [section.key=value ...]``

One trainer rank. Without torchrun (``python -m trainer_daemon ...``) it runs as a one-rank world
on a loopback store. ``asyncrl trainer`` builds the torchrun command line from the config.

The entrypoint is exception-safe: whatever happens, NATS is closed, metrics are flushed and the
process groups are destroyed before the process exits (non-zero on error). Under torchrun a
worker dies with its agent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent() -> None:
    """Under torchrun, ask Linux to SIGKILL this worker when the agent dies.

    torchrun starts each worker in its own session, so a SIGKILL of the agent (OOM killer,
    ``kill -9``, a node agent) would otherwise leave workers training on with nobody watching
    them. No-op elsewhere."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    from asyncrl.cli_args import split_config_args as _split_config_args
    from asyncrl.config import load_config
    from asyncrl.logs import configure_logging

    _die_with_parent()
    path, overrides = _split_config_args(list(sys.argv[1:] if argv is None else argv))
    cfg = load_config(path, overrides)
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(cfg.run.log_level, json_lines=cfg.run.log_json, tag=f"trainer[{rank}]")
    for noisy in ("nats", "torch.distributed.checkpoint"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from trainer_daemon.daemon import TrainerDaemon

    daemon = TrainerDaemon(cfg)
    daemon.install_signal_handlers()
    from trainer_daemon.rank0 import RunEndedUnaccounted

    try:
        daemon.setup()
        daemon.run()
    except RunEndedUnaccounted as exc:
        logging.getLogger("trainer_daemon").error("refusing to start: %s", exc)
        return 1
    except Exception:
        logging.getLogger("trainer_daemon").exception("trainer rank %d failed", rank)
        return 1
    finally:
        daemon.close()
    return daemon.exit_code


if __name__ == "__main__":
    sys.exit(main())
