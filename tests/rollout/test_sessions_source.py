"""``data.source = "sessions"``: the run's data comes only from sessions. The service gets no
prompt of its own (its agents start nothing), no validation set, no reward of a task, and it
never says its data is played out (the run ends at ``trainer.total_training_steps``)."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.config.loader import ConfigError
from rollout_service.prompts import (
    SessionPrompts,
    build_prompt_stream,
    data_problem,
    sessions_only,
    validation_records,
)


def test_the_sessions_source_gives_the_service_nothing_to_play(tmp_path):
    cfg = load_config(overrides=["data.source=sessions", f"run.dir={tmp_path}"], environ={})
    assert sessions_only(cfg.data) and data_problem(cfg.data) is None
    stream = build_prompt_stream(cfg.data, cfg.rollout, tmp_path, chat=None)
    assert isinstance(stream, SessionPrompts) and stream.exhausted and stream.total == 0
    with pytest.raises(StopIteration):
        next(stream)
    assert validation_records(cfg.data, tmp_path) == []
    assert stream.state_dict() == {"driven_by": "sessions"}


def test_files_win_over_the_sessions_source_and_typos_are_refused(tmp_path):
    cfg = load_config(overrides=["data.source=sessions", f'data.train_files=["{tmp_path}/x.jsonl"]'], environ={})
    assert not sessions_only(cfg.data), "with files the service plays them (sessions come on top, as always)"
    with pytest.raises(ConfigError, match="data.source"):
        load_config(overrides=["data.source=session"], environ={})
