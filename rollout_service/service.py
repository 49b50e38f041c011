"""The rollout service: its components, built by :func:`rollout_service.build.build` (which
imports this module, never the other way round), and their lifecycle. ``start`` restores checkpointed agents and
begins admitting, then supervises the background loops (session expiry, engine health,
metrics, progress, loop lag); ``close`` stops everything, leaving the agents' checkpoints for
the next start. The routes get narrow ports from it (``admin_ports``, ``openai_context``,
``metrics_sources``), never the service itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig, secret
from asyncrl.engine_urls import engine_url_refusal
from asyncrl.jetstream import store_sizes
from asyncrl.loops import LoopSupervisor
from asyncrl.progress import ProgressWindow
from asyncrl.sync_control.pause_policy import plan_for
from asyncrl.wire import NatsNames
from asyncrl.wire.rollout_admin import RolloutStatus
from rollout_service.agent.external_tools import ExternalBroker
from rollout_service.api.limits import InflightLimit
from rollout_service.api.ports import AdminPorts
from rollout_service.api.status import service_status
from rollout_service.engines import EnginePool
from rollout_service.loop_lag import LoopLag
from rollout_service.metrics import MetricsSources
from rollout_service.openai.chat_cache import ChatCache
from rollout_service.openai.context import OpenAIContext
from rollout_service.openai.sessions import SessionManager
from rollout_service.prompts import plays_verifiers, sessions_only
from rollout_service.publish.end_of_data import EndOfDataNotice
from rollout_service.rewards import MathReward
from rollout_service.runner.runner import Runner
from tools.registry import ToolRegistry

log = logging.getLogger(__name__)

HEALTH_LOOP_NAME = "engine-health"
METRICS_INTERVAL_S = 5.0  # period of the rollout metrics published on the run's metrics subject


@dataclass
class ToolStats:
    calls: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


class CountingTools:
    """A :class:`ToolRegistry` wrapper that counts calls, errors and time per tool."""

    def __init__(self, registry: ToolRegistry) -> None:
        self.registry = registry
        self.stats = ToolStats()

    async def execute(self, name: str, arguments: Any, timeout_s: float):
        t0 = time.monotonic()
        result = await self.registry.execute(name, arguments, timeout_s)
        key = name if self.registry.get(name) is not None else "<unknown>"
        s = self.stats
        s.calls[key] = s.calls.get(key, 0) + 1
        s.errors[key] = s.errors.get(key, 0) + int(result.is_error)
        s.seconds[key] = s.seconds.get(key, 0.0) + time.monotonic() - t0
        return result


def tool_options(rollout, hidden: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """``rollout.tool_options``, with ``rollout.python_sandbox_url`` given to the python tool, and
    ``hidden`` (the run directory and data roots: issue 48) added to what its runs must not see."""
    options = {name: dict(opts) for name, opts in rollout.tool_options.items()}
    if rollout.python_sandbox_url and "python" in rollout.tools:
        options["python"] = {**options.get("python", {}), "sandbox_url": rollout.python_sandbox_url}
    elif hidden and "python" in rollout.tools:
        python = options.get("python", {})
        options["python"] = {**python, "hidden_paths": [*python.get("hidden_paths", []), *hidden]}
    return options


def sandbox_hidden_paths(run_dir: Path | str, data) -> list[str]:
    """What the python tool's runs must not see: the run directory (trajectories, checkpoints,
    the exported data with its answers) and the directories of the ``data`` section's files."""
    paths = [str(Path(run_dir).resolve())]
    for f in [*data.train_files, *data.val_files]:
        if "://" not in str(f) and ":" not in str(f)[:12]:  # local files only (not hf:, reasoning_gym:, ...)
            paths.append(str(Path(f).resolve().parent))
    return list(dict.fromkeys(paths))


class RolloutService:
    """Owns the NATS connection, the engines, the runner and their background loops."""

    def __init__(self, cfg: RunConfig, *, url: str | None, nc, names: NatsNames, pool: EnginePool, runner: Runner,
                 tools: CountingTools, broker: ExternalBroker, chats: ChatCache, sessions: SessionManager, model_name: str,
                 math_reward: MathReward, env_driver, end_of_data: EndOfDataNotice,
                 publish_metrics: Callable[[dict], Awaitable[None]], inflight_stateless: InflightLimit,
                 inflight_polls: InflightLimit) -> None:
        """Every component constructed by :func:`rollout_service.build.build` (constructor
        injection only); the service starts, supervises and stops them."""
        self.cfg = cfg
        self.url = url
        """This service's own base URL (given by whoever serves it): the verifiers driver
        reaches its sessions there."""
        self.nc, self.names, self.pool, self.runner = nc, names, pool, runner
        self.rid_prefix = runner.rid_prefix
        self.tools, self.broker, self.chats, self.sessions = tools, broker, chats, sessions
        self.model_name, self.math_reward = model_name, math_reward
        self.env_driver = env_driver
        """The verifiers driver's supervisor (``data.source = "verifiers:..."``), else None."""
        self.end_of_data = end_of_data
        self.publish_metrics = publish_metrics
        """Publish a metrics document on the run's metrics subject (best effort)."""
        self.inflight_stateless, self.inflight_polls = inflight_stateless, inflight_polls
        self.started_at = time.time()
        self.store_sizes: dict[str, dict[str, int]] = {}
        """The run's NATS stream and KV buckets: messages and bytes (sampled with the metrics)."""
        self.progress = ProgressWindow(cfg.run.progress_window_s)
        """Counters sampled for the ``health`` block of ``/admin/status`` (:mod:`rollout_service.api.run_health`)."""
        self.loops = LoopSupervisor("the rollout service")
        """Session expiry, engine health, metrics, progress, loop lag (:mod:`asyncrl.loops`)."""
        self.loop_lag = LoopLag()

    def health(self, r, engines: list[dict]) -> dict:
        """The run's health block (:func:`rollout_service.api.run_health.rollout_health`) from a
        runner snapshot and the engines', with the verifiers driver's problem if it has one."""
        from rollout_service.api.run_health import rollout_health

        problem = self.env_driver.problem() if self.env_driver is not None else None
        return rollout_health(r, engines, self.progress, time.time() - self.started_at, environment=problem)

    def status(self) -> RolloutStatus:
        """``GET /admin/status``: the runner's snapshot, the engines, the sessions and tools."""
        r = self.runner.snapshot()
        engines = self.pool.snapshot()
        return service_status(run_id=self.cfg.run.id, uptime_s=time.time() - self.started_at, r=r, engines=engines,
                              health=self.health(r, engines), sessions_open=self.sessions.open_count,
                              sessions_expired=self.sessions.expired_total, tools=self.tools.stats,
                              derived=self.cfg.derived.model_dump(),
                              environment=self.env_driver.status() if self.env_driver is not None else None)

    def metrics_sources(self) -> MetricsSources:
        """What ``/metrics`` reads at each scrape (:mod:`rollout_service.metrics`)."""
        return MetricsSources(snapshot=self.runner.snapshot, health=lambda r: self.health(r, self.pool.snapshot()),
                              engines=lambda: self.pool.engines.values(), store_sizes=lambda: self.store_sizes,
                              tool_stats=lambda: self.tools.stats,
                              environment=lambda: self.env_driver.status() if self.env_driver is not None else None,
                              collectors=(self.runner.publisher.latency, self.loop_lag))

    def liveness(self) -> dict:
        """``GET /health``: the version, whether paused, and how many engines are routable."""
        runner = self.runner.snapshot()
        routable = len(self.pool.routable())
        return {"status": "ok" if routable else "degraded", "version": runner.version, "paused": runner.paused,
                "routable_engines": routable}

    def openai_context(self) -> OpenAIContext:
        """What the OpenAI routes may use (:mod:`rollout_service.openai.context`)."""
        cfg = self.cfg
        return OpenAIContext(api=cfg.api, max_model_len=cfg.model.max_model_len, model_path=cfg.model.path, run_id=cfg.run.id,
                             model_name=self.model_name, started_at=self.started_at, api_token=secret(cfg.security.api_token),
                             environment_tokens={n: secret(t) for n, t in cfg.security.environment_tokens.items()},
                             chats=self.chats, sessions=self.sessions, runner=self.runner, stateless=self.inflight_stateless,
                             long_polls=self.inflight_polls, broker=self.broker)

    def admin_ports(self) -> AdminPorts:
        """What the admin routes may use (:mod:`rollout_service.api.ports`)."""
        return AdminPorts(admin_token=secret(self.cfg.security.admin_token), runner=self.runner, engines=self.pool,
                          status=self.status, validate=self.validate,
                          pause_mode=plan_for(self.cfg.sync, self.cfg.async_training).rollout_mode,
                          pause_timeout_s=self.cfg.rollout.pause_timeout_s,
                          engine_refusal=lambda url: engine_url_refusal(url, self.cfg.engines.urls, self.cfg.engines.allowed_hosts))

    async def validate(self, version: int | None = None) -> dict:
        """Validate now (at the current version unless given); the result is kept for
        ``/admin/status`` and published as metrics."""
        return await self.runner.validation.run(self.runner.version if version is None else version)

    def data_played_out(self) -> bool:
        """Every sample of the run's data is played and published, and nothing else is open
        (:mod:`rollout_service.publish.end_of_data`)."""
        r = self.runner
        if sessions_only(self.cfg.data):
            return False  # sessions may come at any time: the run ends at total_training_steps or when stopped
        if plays_verifiers(self.cfg.data):
            produced = self.env_driver is not None and self.env_driver.state == "finished"
        else:
            produced = r.stream.exhausted
        return produced and not r.tasks and len(r.outbox) == 0 and self.sessions.open_count == 0 and not r.paused

    async def _publish_rollout_metrics(self) -> None:
        """One pass of the metrics loop: the verl metrics, the end-of-data notice once the data
        is played out, the NATS store sizes."""
        from rollout_service.api.status import verl_metrics

        snap = self.runner.snapshot()
        await self.publish_metrics({"kind": "rollout", "version": snap.version, "metrics": verl_metrics(snap)})
        if not self.end_of_data.sent and self.data_played_out():
            await self.end_of_data.send_once(snap.counters.samples_started, snap.counters.trajectories_finished)
        self.store_sizes = await store_sizes(self.nc.jetstream(), self.names)

    async def _observe_progress(self) -> None:
        from rollout_service.api.run_health import progress_counters

        self.progress.observe(progress_counters(self.runner.snapshot()))

    async def _expire_sessions(self) -> None:
        for rec in self.sessions.expire_idle():
            await self.sessions.save(rec)
            await self.runner.drop_member(rec.agent.group_id)
        await self.sessions.forget_closed()
        await self.broker.sweep()

    async def start(self) -> None:
        assert self.runner is not None
        await self.pool.check_once()
        await self.sessions.restore()
        await self.broker.restore()
        await self.runner.start()
        if self.env_driver is not None:
            self.env_driver.start()
        from rollout_service.openai.sessions import EXPIRY_SCAN_S

        self.loops.every("session-expiry", EXPIRY_SCAN_S, self._expire_sessions)
        self.loops.spawn(HEALTH_LOOP_NAME, self.pool.health_loop)
        self.loops.every("metrics", METRICS_INTERVAL_S, self._publish_rollout_metrics)
        self.loops.every("progress", self.progress.interval_s, self._observe_progress)
        self.loops.spawn("loop-lag", self.loop_lag.run)

    async def close(self) -> None:
        self.loops.stop_event.set()
        if self.env_driver is not None:
            await self.env_driver.stop()
        if self.runner is not None:
            await self.runner.stop()
        await self.loops.stop()
        await self.pool.close()
        if self.math_reward is not None:
            self.math_reward.close()
        if self.nc is not None:
            await self.nc.close()
