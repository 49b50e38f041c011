"""``torchrun [torchrun options] -m trainer_daemon [CONFIG] [section.key=value ...]``

One trainer rank. Without torchrun (``python -m trainer_daemon ...``) it runs as a one-rank world
on a loopback store. ``asyncrl trainer`` builds the torchrun command line from the config.

The entrypoint is exception-safe: whatever happens, NATS is closed, metrics are flushed and the
process groups are destroyed before the process exits (non-zero on error).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from asyncrl.cli import _split_config_args
    from asyncrl.config import load_config

    path, overrides = _split_config_args(list(sys.argv[1:] if argv is None else argv))
    cfg = load_config(path, overrides)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=getattr(logging, cfg.run.log_level),
        format=f"%(asctime)s %(levelname)s trainer[{rank}] %(name)s: %(message)s",
    )
    for noisy in ("nats", "torch.distributed.checkpoint"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from trainer_daemon.daemon import TrainerDaemon

    daemon = TrainerDaemon(cfg)
    daemon.install_signal_handlers()
    try:
        daemon.setup()
        daemon.run()
    except Exception:
        logging.getLogger("trainer_daemon").exception("trainer rank %d failed", rank)
        return 1
    finally:
        daemon.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
