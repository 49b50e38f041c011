"""The prompt stream of a run: the configured training files, or the built-in demo task.

With ``data.train_files`` empty, the demo dataset (arithmetic problems that want a
calculator call) is written to ``<run dir>/data/`` once and used; its files are kept so a
restarted service sees the same records (the stream's cursor checks a fingerprint).
"""

from __future__ import annotations

import logging
from pathlib import Path

from asyncrl.config import RunConfig
from rollout_service.agent.chat import ChatTokenizer
from rollout_service.data import (
    ArithSpec,
    PromptStream,
    logging_reporter,
    read_validation_set,
    write_demo_dataset,
)

log = logging.getLogger(__name__)

DEMO_TRAIN_ROWS = 2000
DEMO_VAL_ROWS = 64


def demo_files(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """Paths of the demo task's train and validation files (written when missing)."""
    data_dir = Path(cfg.run_dir) / "data"
    train, val = data_dir / "train.jsonl", data_dir / "val.jsonl"
    if not (train.is_file() and val.is_file()):
        written = write_demo_dataset(data_dir, n_train=DEMO_TRAIN_ROWS, n_val=DEMO_VAL_ROWS, seed=cfg.data.seed,
                                     spec=ArithSpec.level(cfg.data.demo_level))
        log.info("wrote the demo task to %s", written)
    return [str(train)], [str(val)]


def build_prompt_stream(cfg: RunConfig, chat: ChatTokenizer) -> PromptStream:
    files = cfg.data.train_files or demo_files(cfg)[0]
    return PromptStream.from_files(
        files, on_error=logging_reporter(), total_epochs=cfg.rollout.total_epochs, shuffle=cfg.data.shuffle,
        seed=cfg.data.seed, total_rollout_steps=cfg.rollout.total_rollout_steps,
        prompt_length_fn=lambda rec: len(chat.prompt_ids(rec.chat())), max_prompt_length=cfg.data.max_prompt_length,
    )


VAL_MAX_SAMPLES = 256  # validation is a health signal, not a benchmark: bounded cost per run


def validation_records(cfg: RunConfig) -> list:
    """The validation set (``data.val_files``, or the demo task's when training on it); [] if none."""
    if cfg.data.val_files:
        files = cfg.data.val_files
    elif not cfg.data.train_files:
        files = demo_files(cfg)[1]
    else:
        return []
    return read_validation_set(files, max_samples=VAL_MAX_SAMPLES, on_error=logging_reporter())
