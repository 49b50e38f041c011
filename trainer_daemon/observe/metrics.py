"""Trainer metrics on rank 0: one dict per step, under verl's names, fanned out to sinks.

Sinks (each failure is logged once and never stops training):

- Prometheus: its own ``CollectorRegistry`` served on ``trainer.metrics_host:trainer.metrics_port``
  (127.0.0.1 by default; port 0 = a free one; the URL is in ``<run dir>/metrics/trainer_endpoint``
  while the trainer runs).
  A metric ``a/b-c`` becomes the gauge ``asyncrl_a_b_c`` (``/`` and every other character
  Prometheus refuses → ``_``). Gauges also carry live values set between steps
  (``trainer/weight_version``, ``trainer/waiting_for_data_s``).
- JSONL: ``<run dir>/metrics/trainer.jsonl``, one line per step, verl's names as keys plus
  ``step`` and ``time``; flushed per line.
- NATS: core publish of the same JSON to ``asyncrl.<run>.metrics.trainer`` (best effort, no
  JetStream; ``asyncrl up``'s live view subscribes).
- TensorBoard (``"tensorboard"`` in ``trainer.loggers``, on by default): scalars under verl's
  names in ``<run dir>/tensorboard/trainer`` (``torch.utils.tensorboard``).
- Weights & Biases and MLflow (``"wandb"``, ``"mlflow"``): :mod:`trainer_daemon.observe.tracking`,
  passed in as ``extra_sinks``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, start_http_server

log = logging.getLogger(__name__)

PROM_PREFIX = "asyncrl_"
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(name: str) -> str:
    """verl name → Prometheus gauge name (module docstring)."""
    return PROM_PREFIX + _INVALID.sub("_", name)


class PrometheusSink:
    def __init__(self, host: str, port: int) -> None:
        self.registry = CollectorRegistry()
        self._gauges: dict[str, Gauge] = {}
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        self.url = f"http://{host}:{self.port}/metrics"

    def set(self, name: str, value: float) -> None:
        g = self._gauges.get(name)
        if g is None:
            g = self._gauges[name] = Gauge(prometheus_name(name), f"verl name: {name}", registry=self.registry)
        g.set(value)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.set(k, v)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class JsonlSink:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._f.write(json.dumps({"step": step, "time": time.time(), **_finite(metrics)}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self._w = SummaryWriter(log_dir=str(logdir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class CallbackSink:
    """Hands the JSON line to a callable (the NATS publish on the I/O loop)."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self._send = send

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._send(json.dumps({"step": step, "time": time.time(), **_finite(metrics)}).encode())

    def close(self) -> None:
        pass


def _finite(metrics: dict[str, float]) -> dict[str, float | None]:
    return {k: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()}


class MetricsHub:
    """Fans step metrics out to the configured sinks (rank 0)."""

    def __init__(self, run_dir: Path, loggers: list[str], host: str, port: int,
                 send: Callable[[bytes], None] | None = None, extra_sinks: list | None = None) -> None:
        self.sinks: list = []
        self._broken: set[int] = set()
        self.prometheus = PrometheusSink(host, port)
        self.sinks.append(self.prometheus)
        self._endpoint = endpoint = Path(run_dir) / "metrics" / "trainer_endpoint"
        endpoint.parent.mkdir(parents=True, exist_ok=True)
        endpoint.write_text(self.prometheus.url + "\n")
        log.info("trainer metrics at %s", self.prometheus.url)
        if "jsonl" in loggers:
            self.sinks.append(JsonlSink(Path(run_dir) / "metrics" / "trainer.jsonl"))
        if "tensorboard" in loggers:
            try:
                self.sinks.append(TensorBoardSink(Path(run_dir) / "tensorboard" / "trainer"))
            except ImportError as exc:
                log.warning("tensorboard logger unavailable (%s); pip install tensorboard", exc)
        self.sinks.extend(extra_sinks or [])
        if send is not None:
            self.sinks.append(CallbackSink(send))

    def live(self, name: str, value: float) -> None:
        """A value between steps (Prometheus only)."""
        self.prometheus.set(name, value)

    def emit(self, step: int, metrics: dict[str, float]) -> None:
        for i, sink in enumerate(self.sinks):
            try:
                sink.write(step, metrics)
            except Exception as exc:  # noqa: BLE001 - a metrics sink never stops training
                if i not in self._broken:
                    log.warning("metrics sink %s failed: %s", type(sink).__name__, exc)
                    self._broken.add(i)

    def close(self) -> None:
        self._endpoint.unlink(missing_ok=True)  # no stale URL for the next reader
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - shutting down
                log.debug("closing %s: %s", type(sink).__name__, exc)
