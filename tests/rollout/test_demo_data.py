"""Issue 50 item 4: the demo is the launcher's. The rollout service trains on the files it is
given and refuses to start without data; ``asyncrl rollout`` writes the demo task's files once
and passes their paths when the run has no data of its own."""

from __future__ import annotations

import json

from asyncrl.config import load_config
from launcher.demo_data import TRAIN_ENV, VAL_ENV, demo_data_env
from rollout_service.__main__ import main as rollout_main

ADMIN = "test-admin-token-0123456789"


def test_the_rollout_service_refuses_to_start_without_data(tmp_path, capsys):
    assert rollout_main([f"run.dir={tmp_path / 'run'}", f"security.admin_token={ADMIN}"]) == 2
    err = capsys.readouterr().err
    assert "refusing to start: no data" in err and "data.train_files" in err and "data.source" in err
    assert not (tmp_path / "run" / "data").exists(), "the service writes no demo files of its own"


def test_the_launcher_writes_the_demo_files_once_and_points_the_service_at_them(tmp_path):
    cfg = load_config(overrides=[f"run.dir={tmp_path / 'run'}", "data.demo_level=1"], environ={})
    env = demo_data_env(cfg)
    train, val = json.loads(env[TRAIN_ENV]), json.loads(env[VAL_ENV])
    rows = [json.loads(line) for line in open(train[0])]
    assert len(rows) == 2000 and rows[0]["reward_model"]["ground_truth"] and len(open(val[0]).readlines()) == 64
    before = (tmp_path / "run" / "data" / "train.jsonl").stat().st_mtime_ns
    again = demo_data_env(cfg)
    assert again == env and (tmp_path / "run" / "data" / "train.jsonl").stat().st_mtime_ns == before  # kept, not rewritten
    given = load_config(overrides=[f"run.dir={tmp_path / 'run'}"], environ=env)
    assert given.data.train_files == train and given.data.val_files == val
    # a run with data of its own gets nothing
    own = tmp_path / "own.jsonl"
    own.write_text(open(train[0]).readline())
    for overrides in ([f"data.train_files=[{own}]"], ["data.source=reasoning_gym:basic_arithmetic"]):
        assert demo_data_env(load_config(overrides=[f"run.dir={tmp_path / 'other'}", *overrides], environ={})) == {}
    assert not (tmp_path / "other").exists()
