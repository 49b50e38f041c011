"""The sync agent process: wires the coordinator, the reconcile loop and recovery."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from asyncrl.config import secret
from asyncrl.loops import LoopSupervisor
from asyncrl.progress import ProgressWindow
from sync_agent import reconcile
from sync_agent.coordinator import CoordinatorSettings, SyncCoordinator
from sync_agent.reconcile import recover
from sync_agent.records import StateFile
from sync_agent.rollout_admin import RolloutAdmin

log = logging.getLogger(__name__)


def rollout_url(sync, rollout) -> str:
    """The rollout service's base URL: ``sync.rollout_url``, else the ``rollout`` section's
    host (loopback for a wildcard bind) and port."""
    if sync.rollout_url:
        return sync.rollout_url
    host = "127.0.0.1" if rollout.host in ("0.0.0.0", "::") else rollout.host
    return f"http://{host}:{rollout.listen_port}"


class PolicyRefused(RuntimeError):
    """``sync.pause_policy`` cannot run on the configured engines (see the message)."""


class SyncAgent:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.rollout = RolloutAdmin(rollout_url(cfg.sync, cfg.rollout), secret(cfg.security.admin_token), timeout_s=cfg.sync.engine_timeout_s)
        self.coordinator = SyncCoordinator(CoordinatorSettings.from_config(cfg), StateFile(Path(cfg.run_dir) / "sync" / "state.json"), self.rollout)
        self.progress = ProgressWindow(cfg.run.progress_window_s)
        """The tally's counters sampled for the ``health`` block of ``/status`` (:mod:`sync_agent.health`)."""
        self.started_at = time.time()
        self.loops = LoopSupervisor("the sync agent")
        """Queued syncs, reconcile rounds, progress (:mod:`asyncrl.loops`: a bug in one is logged
        and it starts again, instead of ending syncs or repairs for good)."""

    async def start(self) -> None:
        """Recover an interrupted sync and start the loops. Raises :class:`PolicyRefused` (the
        process does not start) when the run cannot sync on the configured engines
        (:meth:`SyncCoordinator.problems_at_start`)."""
        problems = await self.coordinator.problems_at_start()
        if problems:
            raise PolicyRefused("refusing to start: " + "; ".join(problems))
        try:
            state = await recover(self.coordinator)
            if state:
                log.warning("finished an interrupted sync at start: %s", state)
        except Exception:  # noqa: BLE001 - recovery is retried by the reconcile loop's rules
            log.exception("recovery at start failed")
        self.loops.spawn("syncs", self.coordinator.run)
        # looked up on the module at each round (tests count the rounds by wrapping it)
        self.loops.every("reconcile", self.cfg.sync.reconcile_interval_s, lambda: reconcile.reconcile_once(self.coordinator))
        self.loops.every("progress", self.progress.interval_s, self._observe_progress)

    async def _observe_progress(self) -> None:
        self.progress.observe(self.coordinator.tally.counters())

    async def close(self) -> None:
        await self.loops.stop()
        await self.coordinator.liveness.close()
        await self.coordinator.fleet.close()
        await self.rollout.close()
