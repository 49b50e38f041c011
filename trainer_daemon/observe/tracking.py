"""Experiment trackers as metric sinks: Weights & Biases and MLflow, through their own libraries.

Named in ``trainer.loggers`` (``"wandb"``, ``"mlflow"``) beside ``jsonl`` and ``tensorboard``
(:mod:`trainer_daemon.observe.metrics`); each gets every step's metrics under verl's names, at the
trainer's global step, on rank 0 only. Both are optional extras (``asyncrl[tracking]``); a
logger named without its package is a clear error at start.

- **W&B**: ``wandb.init(project=trainer.project_name, name=experiment, id=run.id,
  resume="allow", dir=<run dir>, mode=trainer.wandb_mode)``. ``offline`` (the default) writes
  the run under ``<run dir>/wandb/`` with no network (``wandb sync`` uploads it later);
  ``online`` needs ``WANDB_API_KEY``. The resolved run config is the run's config. A restarted
  trainer resumes the same W&B run (same id).
- **MLflow**: tracking URI ``trainer.mlflow_tracking_uri`` (None: a file store under
  ``<run dir>/mlruns``), experiment ``trainer.project_name``, run name = the experiment name;
  the MLflow run id is kept in ``<run dir>/metrics/mlflow_run_id`` so a restarted trainer logs
  to the same run. Non-finite values are skipped (MLflow refuses them).

The experiment name is ``trainer.experiment_name`` or the run id. Failures while logging are
handled by the hub (logged once, never stop training).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class TrackingConfigError(RuntimeError):
    """A tracker named in ``trainer.loggers`` that cannot start (package missing)."""


def _require(module: str, logger: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TrackingConfigError(f"trainer.loggers has {logger!r} but the {module} package is not installed: "
                                  "pip install -c constraints/cpu.txt 'asyncrl[tracking]'") from None


class WandbSink:
    def __init__(self, run_dir: Path, project: str, name: str, run_id: str, mode: str, config: dict[str, Any]) -> None:
        wandb = _require("wandb", "wandb")
        self._run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(run_dir), mode=mode,
                               config=config, reinit="create_new")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log({k: v for k, v in metrics.items() if math.isfinite(v)}, step=step, commit=True)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    def __init__(self, run_dir: Path, uri: str | None, experiment: str, name: str, params: dict[str, Any]) -> None:
        mlflow = _require("mlflow", "mlflow")
        self._client = mlflow.MlflowClient(tracking_uri=uri or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}")
        exp = self._client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(experiment)
        id_file = Path(run_dir) / "metrics" / "mlflow_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        if run_id is None:
            run_id = self._client.create_run(exp_id, run_name=name).info.run_id
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
            for key, value in list(params.items())[:100]:  # MLflow caps params per batch; the flat config's first 100
                self._client.log_param(run_id, key, str(value)[:500])
        self.run_id = run_id

    def write(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if math.isfinite(v)]
        for i in range(0, len(batch), 1000):  # MLflow's batch limit
            self._client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def build_tracking_sinks(cfg) -> list:
    """The trackers ``trainer.loggers`` names (module docstring), each given the whole config
    to record; [] when none."""
    t = cfg.trainer
    name = t.experiment_name or cfg.run.id
    sinks: list = []
    if "wandb" in t.loggers:
        config = cfg.model_dump(mode="json", exclude={"security"})
        sinks.append(WandbSink(Path(cfg.run_dir), t.project_name, name, cfg.run.id, t.wandb_mode, config))
    if "mlflow" in t.loggers:
        params = _flat(cfg.model_dump(mode="json", exclude={"security"}))
        sinks.append(MlflowSink(Path(cfg.run_dir), t.mlflow_tracking_uri, t.project_name, name, params))
    return sinks
