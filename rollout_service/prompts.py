"""The prompt stream of a run: the configured training files, a generated task
(``data.source``: :mod:`rollout_service.data.reasoning_gym_task`), or the built-in demo task.
A verifiers environment (``data.source = "verifiers:..."``) brings its own data and agent: the
runner then gets :class:`~rollout_service.verifiers_env.supervisor.DriverPrompts` (no prompts
for its own agents), no validation set and no reward of its own.

With ``data.train_files`` and ``data.source`` empty, the demo dataset (arithmetic problems that want a
calculator call) is written to ``<run dir>/data/`` once and used; its files are kept so a
restarted service sees the same records (the stream's cursor checks a fingerprint).
"""

from __future__ import annotations

import logging
from pathlib import Path

from asyncrl.chat import ChatTokenizer
from asyncrl.config.sections_core import DataConfig, RolloutConfig
from recipes.demo.task import ArithSpec, write_demo_dataset
from rollout_service.data import PromptStream, logging_reporter, read_validation_set

log = logging.getLogger(__name__)

DEMO_TRAIN_ROWS = 2000
DEMO_VAL_ROWS = 64


def demo_files(data: DataConfig, run_dir: Path | str) -> tuple[list[str], list[str]]:
    """Paths of the demo task's train and validation files (written when missing)."""
    data_dir = Path(run_dir) / "data"
    train, val = data_dir / "train.jsonl", data_dir / "val.jsonl"
    if not (train.is_file() and val.is_file()):
        written = write_demo_dataset(data_dir, n_train=DEMO_TRAIN_ROWS, n_val=DEMO_VAL_ROWS, seed=data.seed,
                                     spec=ArithSpec.level(data.demo_level))
        log.info("wrote the demo task to %s", written)
    return [str(train)], [str(val)]


def plays_verifiers(data: DataConfig) -> bool:
    """Whether a verifiers environment produces the run's trajectories (``data.source``)."""
    return bool(data.source) and data.source.startswith("verifiers:") and not data.train_files


def source_files(data: DataConfig, run_dir: Path | str) -> tuple[list[str], list[str]]:
    """Train and validation files of ``data.source`` (generated once under the run dir)."""
    from rollout_service.data.reasoning_gym_task import task_name, write_dataset

    d = data
    train, val = write_dataset(Path(run_dir) / "data", task_name(d.source), d.source_options, d.source_size,
                               d.source_val_size, d.seed)
    return [str(train)], ([str(val)] if d.source_val_size > 0 else [])


def generated_files(data: DataConfig, run_dir: Path | str) -> tuple[list[str], list[str]]:
    """The files of whatever is configured instead of ``data.train_files``."""
    return source_files(data, run_dir) if data.source else demo_files(data, run_dir)


def build_prompt_stream(data: DataConfig, rollout: RolloutConfig, run_dir: Path | str, chat: ChatTokenizer, driver=None):
    """The runner's prompt stream: a :class:`PromptStream`, or DriverPrompts reading ``driver``
    (the verifiers driver's supervisor) for a verifiers source."""
    if plays_verifiers(data):
        from rollout_service.verifiers_env.supervisor import DriverPrompts

        return DriverPrompts(driver)
    files = data.train_files or generated_files(data, run_dir)[0]
    return PromptStream.from_files(
        files, on_error=logging_reporter(), total_epochs=rollout.total_epochs, shuffle=data.shuffle,
        seed=data.seed, total_rollout_steps=rollout.total_rollout_steps,
        prompt_length_fn=lambda rec: len(chat.prompt_ids(rec.chat())), max_prompt_length=data.max_prompt_length,
    )


VAL_MAX_SAMPLES = 256  # validation is a health signal, not a benchmark: bounded cost per run


def validation_records(data: DataConfig, run_dir: Path | str) -> list:
    """The validation set (``data.val_files``, or the generated task's when training on it); [] if none."""
    if data.val_files:
        files = data.val_files
    elif plays_verifiers(data):
        return []
    elif not data.train_files:
        files = generated_files(data, run_dir)[1]
    else:
        return []
    if not files:
        return []
    return read_validation_set(files, max_samples=VAL_MAX_SAMPLES, on_error=logging_reporter())


def source_reward(data: DataConfig) -> tuple[str, object]:
    """``(data_source, reward function)`` of ``data.source``: the task's own verifier."""
    from rollout_service.data.reasoning_gym_task import DATA_SOURCE_PREFIX, task_name
    from rollout_service.rewards.reasoning_gym_reward import ReasoningGymReward

    d = data
    name = task_name(d.source)
    fallback = "last_number" if d.source_answer == "tag_or_last_number" else None
    return DATA_SOURCE_PREFIX + name, ReasoningGymReward(name, d.source_options, d.source_size, d.source_val_size, d.seed,
                                                         answer_fallback=fallback)
