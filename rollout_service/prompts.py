"""The prompt stream of a run: the configured training files, or a generated task
(``data.source``: :mod:`rollout_service.data.reasoning_gym_task`). A verifiers environment
(``data.source = "verifiers:..."``) brings its own data and agent: the runner then gets
:class:`~rollout_service.verifiers_env.supervisor.DriverPrompts` (no prompts for its own
agents), no validation set and no reward of its own. ``data.source = "sessions"`` likewise:
:class:`SessionPrompts` (the service runs no agents of its own; external agents bring the
episodes and their rewards through sessions).

The service trains on data it is given: with neither ``data.train_files`` nor ``data.source``
it refuses to start (:func:`data_problem`). The built-in demo task is the launcher's: ``asyncrl
rollout`` writes its files and passes their paths (:mod:`launcher.demo_data`); no service
imports a recipe (issue 50).
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.chat import ChatTokenizer
from asyncrl.config.sections_core import DataConfig, RolloutConfig
from rollout_service.data import PromptStream, logging_reporter, read_validation_set


def data_problem(data: DataConfig) -> str | None:
    """Why the run has no data to train on, or None."""
    if data.train_files or data.source:
        return None
    return ("no data: set data.train_files (verl-layout JSONL or Parquet) or data.source (a generated task or a "
            "verifiers environment); `asyncrl rollout` (and asyncrl up, Slurm, compose) writes the built-in demo "
            "task and passes its files when neither is set")


def sessions_only(data: DataConfig) -> bool:
    """Whether every trajectory of the run comes from sessions (``data.source = "sessions"``)."""
    return data.source == "sessions" and not data.train_files


class SessionPrompts:
    """The runner's prompt stream when sessions bring all the data: no prompt for the
    service's own agents, ``total`` 0 (nothing of its own to play), never played out."""

    produced = 0
    total = 0
    epoch = 0
    exhausted = True  # for the runner's own agents

    def __next__(self):
        raise StopIteration

    def state_dict(self) -> dict[str, str]:
        return {"driven_by": "sessions"}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        return None


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


def build_prompt_stream(data: DataConfig, rollout: RolloutConfig, run_dir: Path | str, chat: ChatTokenizer, driver=None):
    """The runner's prompt stream: a :class:`PromptStream`, or DriverPrompts reading ``driver``
    (the verifiers driver's supervisor) for a verifiers source."""
    if plays_verifiers(data):
        from rollout_service.verifiers_env.supervisor import DriverPrompts

        return DriverPrompts(driver)
    if sessions_only(data):
        return SessionPrompts()
    problem = data_problem(data)
    if problem:
        raise ValueError(problem)
    files = data.train_files or source_files(data, run_dir)[0]
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
    elif plays_verifiers(data) or sessions_only(data):
        return []
    elif data.source and not data.train_files:
        files = source_files(data, run_dir)[1]
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
