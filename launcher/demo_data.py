"""The built-in demo task's data, written by the launcher (issue 50 item 4): the rollout service
trains on files it is given and never imports a recipe.

:func:`demo_data_env` is what ``asyncrl rollout`` (and so ``asyncrl up``, a Slurm job and
compose, which all start the rollout service through it) does before the service reads its
config: when the run has no data (``data.train_files``, ``data.source`` and a verifiers
environment all absent), it writes the demo's ``train.jsonl`` and ``val.jsonl`` under
``<run dir>/data/`` (once: kept, so a restarted service reads the same records and its stream
cursor's fingerprint matches) and returns the environment overrides
(``ASYNCRL_DATA__TRAIN_FILES`` / ``ASYNCRL_DATA__VAL_FILES``) that point the service at them.
Configured data, even an empty command-line list, is never replaced: the environment is the
weakest source of the config (asyncrl/config/loader.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from asyncrl.config import RunConfig
from asyncrl.config.sections_core import DataConfig

log = logging.getLogger(__name__)

DEMO_TRAIN_ROWS = 2000
DEMO_VAL_ROWS = 64
TRAIN_ENV, VAL_ENV = "ASYNCRL_DATA__TRAIN_FILES", "ASYNCRL_DATA__VAL_FILES"


def needs_demo_data(data: DataConfig) -> bool:
    """Whether the run has no data of its own (no files, no generated source, no verifiers env)."""
    return not data.train_files and not data.source


def write_demo_files(data: DataConfig, run_dir: Path | str) -> tuple[Path, Path]:
    """The demo's train and validation files under ``<run dir>/data`` (written when missing)."""
    from recipes.demo.task import ArithSpec, write_demo_dataset

    data_dir = Path(run_dir) / "data"
    train, val = data_dir / "train.jsonl", data_dir / "val.jsonl"
    if not (train.is_file() and val.is_file()):
        write_demo_dataset(data_dir, n_train=DEMO_TRAIN_ROWS, n_val=DEMO_VAL_ROWS, seed=data.seed,
                           spec=ArithSpec.level(data.demo_level))
        log.info("wrote the demo task to %s", data_dir)
    return train, val


def demo_data_env(cfg: RunConfig) -> dict[str, str]:
    """The environment that gives the rollout service the demo's files ({} when it has data)."""
    if not needs_demo_data(cfg.data):
        return {}
    train, val = write_demo_files(cfg.data, cfg.run_dir)
    env = {TRAIN_ENV: json.dumps([str(train)])}
    if not cfg.data.val_files:
        env[VAL_ENV] = json.dumps([str(val)])
    return env
