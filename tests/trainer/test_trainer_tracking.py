"""Experiment tracking: every step's metrics under verl's names reach TensorBoard (default), W&B
(offline, no network) and MLflow (a local SQLite store), each read back through its own
library; a restarted trainer logs to the same W&B and MLflow runs."""

from __future__ import annotations

import glob
import json

import pytest

from asyncrl.config import load_config
from trainer_daemon.observe.metrics import MetricsHub
from trainer_daemon.observe.tracking import TrackingConfigError, build_tracking_sinks

STEPS = {1: {"actor/pg_loss": 0.5, "critic/rewards/mean": 0.25, "actor/entropy": float("nan")},
         2: {"actor/pg_loss": 0.375, "critic/rewards/mean": 0.5}}


def _cfg(run_dir, loggers):
    return load_config(overrides=[f"run.dir={run_dir}", "run.id=track-1", f"trainer.loggers={json.dumps(loggers)}",
                                  "trainer.project_name=asyncrl-tests"], environ={})


def _run(cfg, steps):
    hub = MetricsHub(cfg.run_dir, list(cfg.trainer.loggers), "127.0.0.1", 0, extra_sinks=build_tracking_sinks(cfg))
    try:
        for step, metrics in steps.items():
            hub.emit(step, metrics)
    finally:
        hub.close()


def test_tensorboard_is_on_by_default_and_keeps_verls_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(overrides=[f"run.dir={tmp_path}"], environ={})
    assert cfg.trainer.loggers == ["jsonl", "tensorboard"]
    _run(cfg, STEPS)
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "trainer"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("actor/pg_loss")] == [(1, 0.5), (2, 0.375)]


def test_wandb_offline_and_mlflow_get_every_step_and_a_restart_continues_their_runs(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, ["jsonl", "wandb", "mlflow"])
    _run(cfg, STEPS)
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-track-1.wandb"))
    # the offline run file (what `wandb sync` uploads) holds the history records: the names and values
    assert len(files) == 1
    data = open(files[0], "rb").read()
    assert all(token in data for token in (b"actor/pg_loss", b"critic/rewards/mean", b"0.375", b"asyncrl-tests"))

    run_id = (tmp_path / "metrics" / "mlflow_run_id").read_text().strip()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(run_id, "actor/pg_loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.375)]
    assert client.get_metric_history(run_id, "actor/entropy") == []  # NaN is skipped, not an error
    run = client.get_run(run_id)
    assert run.info.run_name == "track-1" and run.data.params["run.id"] == "track-1"
    assert client.get_experiment(run.info.experiment_id).name == "asyncrl-tests"

    _run(cfg, {3: {"actor/pg_loss": 0.25}})  # a restarted trainer
    assert (tmp_path / "metrics" / "mlflow_run_id").read_text().strip() == run_id
    assert [m.step for m in client.get_metric_history(run_id, "actor/pg_loss")] == [1, 2, 3]
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert len(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-track-1.wandb"))) >= 1


def test_a_tracker_without_its_package_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an install without the extra looks like to import
    with pytest.raises(TrackingConfigError, match=r"'mlflow'.*asyncrl\[tracking\]"):
        build_tracking_sinks(_cfg(tmp_path, ["mlflow"]))
