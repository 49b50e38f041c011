"""The rollout service's side of the verifiers driver: start it, restart it, stop it, report it.

:class:`DriverSupervisor` runs ``python -m rollout_service.verifiers_env.driver`` as a child
process of the service (its log: ``<run dir>/rollout/verifiers/driver.log``):

- exit 0: every group played; ``finished``, not restarted;
- exit 2: the environment cannot be loaded (package missing, ``load_environment`` failed):
  ``failed``, not restarted — a configuration problem, reported in ``/admin/status`` and the
  run's health with the log's last lines;
- any other end (a crash, a kill): restarted after ``min(2 ** k, RESTART_BACKOFF_MAX_S)``
  seconds (``k`` the crashes in a row so far, reset by one that ran ``STABLE_S``), counted in
  ``restarts``. The restarted driver continues from its progress file (:mod:`.plan`).

``stop()`` sends SIGTERM, then SIGKILL after ``STOP_GRACE_S``. If the service itself dies, the
driver notices it was orphaned and exits (:func:`.driver.exit_when_orphaned`).

:class:`DriverPrompts` stands in for the runner's prompt stream when the data come from the
driver: it never gives the runner's own agents a prompt (they stay idle), and reports the
driver's progress (groups started of the plan's total) where the prompt stream's would be
(``/admin/status`` ``prompts``; the run's health says ``finished`` once all were played).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.files import atomic_write
from asyncrl.launch import log_tail
from rollout_service.openai.handlers import served_model_name
from rollout_service.verifiers_env.plan import Progress
from rollout_service.verifiers_env.spec import (
    DATA_SOURCE_PREFIX,
    PROGRESS_FILE,
    SPEC_FILE,
    TOKEN_ENV,
    DriverSpec,
    env_id_of,
)

log = logging.getLogger(__name__)

RESTART_BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # a driver that ran this long before crashing resets the backoff
STOP_GRACE_S = 10.0
EXIT_FINISHED, EXIT_LOAD_FAILED = 0, 2


def state_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "rollout" / "verifiers"


def check_config(data, rollout) -> None:
    """ValueError for ``data`` / ``rollout`` sections a verifiers source cannot honour (the
    service refuses to start)."""
    env_id_of(data.source or "")
    if rollout.sampling.top_k != -1:
        raise ValueError(f"rollout.sampling.top_k = {rollout.sampling.top_k}: a verifiers source samples through the "
                         "OpenAI API, which has no top_k; leave it at -1")


def build_driver_spec(cfg: RunConfig, url: str, max_concurrent: int) -> DriverSpec:
    """The driver's spec from the run config (module doc of :mod:`.driver`)."""
    check_config(cfg.data, cfg.rollout)
    env_id = env_id_of(cfg.data.source or "")
    s, e = cfg.rollout.sampling, cfg.engines
    max_tokens = min(s.max_new_tokens, cfg.rollout.response_length)
    sampling: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": max_tokens}
    # one completion: the engine call's own bound (engines.request_timeout_s or its derived form), after
    # waiting out a weight sync's pause at most
    generate_s = e.request_timeout_s or e.request_timeout_floor_s + max_tokens / e.min_decode_tokens_per_s
    return DriverSpec(url=url, env_id=env_id, env_args=dict(cfg.data.source_options), data_source=DATA_SOURCE_PREFIX + env_id,
                      n=cfg.rollout.n, max_concurrent=max_concurrent, total_groups=cfg.rollout.total_rollout_steps,
                      total_epochs=cfg.rollout.total_epochs, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
                      model=served_model_name(cfg.api, cfg.model), sampling=sampling, state_dir=str(state_dir(cfg.run_dir)),
                      request_timeout_s=generate_s + cfg.rollout.pause_timeout_s)


class DriverSupervisor:
    def __init__(self, spec: DriverSpec, api_token: str) -> None:
        self.spec, self.api_token = spec, api_token
        self.dir = Path(spec.state_dir)
        self.log_path = self.dir / "driver.log"
        self.state = "starting"
        self.restarts = 0
        self.last_exit: int | None = None
        self.last_error = ""
        self.proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.dir / SPEC_FILE, self.spec.model_dump_json(indent=1))
        self._task = asyncio.create_task(self._supervise(), name="verifiers-driver")

    async def _spawn(self) -> asyncio.subprocess.Process:
        env = {**os.environ, TOKEN_ENV: self.api_token}
        with open(self.log_path, "ab") as logf:
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rollout_service.verifiers_env.driver", str(self.dir / SPEC_FILE),
                stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf, env=env)

    async def _supervise(self) -> None:
        crashes = 0
        while not self._stopping:
            started = time.monotonic()
            self.proc = await self._spawn()
            self.state = "running"
            log.info("verifiers driver started (pid %d, log %s)", self.proc.pid, self.log_path)
            rc = await self.proc.wait()
            self.last_exit = rc
            if self._stopping:
                break
            if rc == EXIT_FINISHED:
                self.state = "finished"
                log.info("verifiers driver finished: every group played")
                return
            self.last_error = log_tail(self.log_path, 1500).strip()
            if rc == EXIT_LOAD_FAILED:
                self.state = "failed"
                log.error("the verifiers environment cannot be loaded; the driver is not restarted:\n%s", self.last_error)
                return
            crashes = 1 if time.monotonic() - started >= STABLE_S else crashes + 1
            self.restarts += 1
            self.state = "restarting"
            wait = min(2.0 ** (crashes - 1), RESTART_BACKOFF_MAX_S)
            log.warning("verifiers driver exited with %s; restarting in %.0f s (restart %d)", rc, wait, self.restarts)
            await asyncio.sleep(wait)

    async def stop(self) -> None:
        self._stopping = True
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.state in ("running", "restarting", "starting"):
            self.state = "stopped"

    def progress(self) -> Progress | None:
        return Progress.read(self.dir / PROGRESS_FILE)

    def status(self) -> dict[str, Any]:
        """The ``environment`` block of ``/admin/status``."""
        p = self.progress()
        out: dict[str, Any] = {"kind": "verifiers", "env_id": self.spec.env_id, "state": self.state,
                               "pid": self.proc.pid if self.proc is not None and self.proc.returncode is None else None,
                               "restarts": self.restarts, "last_exit": self.last_exit, "log": str(self.log_path)}
        if p is not None:
            out.update({"groups_total": p.total, "groups_started": p.started, "groups_finished": p.finished,
                        "episodes_failed": p.failed, "group_errors": p.errors, "sessions_open": len(p.open_sessions)})
        if self.state in ("failed", "restarting") and self.last_error:
            out["last_error"] = self.last_error[-600:]
        return out

    def problem(self) -> str | None:
        """Why the driver stands in the run's way (for the health block), or None."""
        if self.state == "failed":
            return f"the verifiers environment {self.spec.env_id!r} cannot be loaded (see {self.log_path}): {self.last_error[-300:]}"
        if self.state == "restarting":
            return f"the verifiers driver crashed (restart {self.restarts}, exit {self.last_exit}); see {self.log_path}"
        return None


class DriverPrompts:
    """The runner's prompt stream when the driver plays the data (module doc)."""

    def __init__(self, supervisor: DriverSupervisor | None = None) -> None:
        self.supervisor = supervisor

    def _progress(self) -> Progress | None:
        return None if self.supervisor is None else self.supervisor.progress()

    @property
    def produced(self) -> int:
        p = self._progress()
        return 0 if p is None else p.started

    @property
    def total(self) -> int:
        p = self._progress()
        return 1 if p is None else p.total  # unknown until the driver loaded its dataset: not finished

    @property
    def epoch(self) -> int:
        return 0

    @property
    def exhausted(self) -> bool:
        return True  # for the runner's own agents

    def __next__(self):
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        return {"driven_by": "verifiers"}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        return None
