"""Building the rollout service from the run config, and its lifecycle.

``RolloutService.create(cfg)`` connects to NATS (``nats.url`` or the run's embedded server),
ensures the run's stream and KV buckets, loads the tokenizer, tools, rewards and prompts,
opens the outbox in ``<run dir>/rollout/outbox`` and wires the :class:`Runner`. ``start``
restores checkpointed agents and begins admitting; ``close`` stops everything, leaving the
agents' checkpoints for the next start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from asyncrl.chat import ChatTokenizer
from asyncrl.config import RunConfig, secret
from asyncrl.jetstream import (
    StreamSettings,
    connect,
    ensure_kv,
    ensure_stream,
    kv_forget,
    resolve_nats_url,
    store_sizes,
)
from asyncrl.jsonl_log import BoundedJsonl
from asyncrl.loops import LoopSupervisor
from asyncrl.models import load_tokenizer
from asyncrl.progress import ProgressWindow
from asyncrl.sync_control.pause_policy import plan_for
from asyncrl.wire import NatsNames
from asyncrl.wire.rollout_admin import RolloutStatus
from asyncrl.wire.sync import adapter_name, weight_version_number
from rollout_service.agent.deps import AgentDeps
from rollout_service.agent.external_tools import ExternalBroker
from rollout_service.agent.tool_parser import PARSERS
from rollout_service.api.limits import InflightLimit
from rollout_service.api.ports import AdminPorts
from rollout_service.api.status import service_status
from rollout_service.engines import EnginePool
from rollout_service.loop_lag import LoopLag
from rollout_service.metrics import MetricsSources
from rollout_service.openai.context import OpenAIContext
from rollout_service.openai.handlers import ChatCache, served_model_name
from rollout_service.openai.sessions import SessionManager
from rollout_service.prompts import (
    build_prompt_stream,
    plays_verifiers,
    source_reward,
    validation_records,
)
from rollout_service.publish import Outbox, TrajectoryPublisher
from rollout_service.publish.end_of_data import EndOfDataNotice
from rollout_service.rewards import MathReward, default_registry
from rollout_service.runner.finish import model_text
from rollout_service.runner.runner import Runner, RunnerSettings
from rollout_service.runner.store import AgentStore, KvRecords, RunnerStateStore
from rollout_service.runner.validation import run_validation
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


def tool_options(rollout) -> dict[str, dict[str, Any]]:
    """``rollout.tool_options``, with ``rollout.python_sandbox_url`` given to the python tool."""
    options = {name: dict(opts) for name, opts in rollout.tool_options.items()}
    if rollout.python_sandbox_url and "python" in rollout.tools:
        options["python"] = {**options.get("python", {}), "sandbox_url": rollout.python_sandbox_url}
    return options


class RolloutService:
    """Owns the NATS connection, the engines, the runner and their background loops."""

    def _lora_route(self) -> tuple[str, int] | None:
        """Adapter syncs: the current version's adapter (version 0 is the base model itself:
        a fresh adapter adds zero)."""
        if not self.cfg.syncs_adapters or self.runner is None or self.runner.version == 0:
            return None
        return adapter_name(self.cfg.run.id, self.runner.version), self.runner.version

    def __init__(self, cfg: RunConfig, url: str | None = None) -> None:
        self.cfg = cfg
        self.names = NatsNames(cfg.run.id)
        self.rid_prefix = f"rl-{cfg.run.id}."
        self.started_at = time.time()
        self.nc = None
        self.runner: Runner | None = None
        self.pool = EnginePool(api_key=secret(cfg.engines.api_key),
                               admin_api_key=secret(cfg.engines.admin_api_key),
                               request_timeout_s=cfg.engines.request_timeout_s, control_timeout_s=cfg.engines.control_timeout_s,
                               request_timeout_floor_s=cfg.engines.request_timeout_floor_s,
                               min_decode_tokens_per_s=cfg.engines.min_decode_tokens_per_s,
                               paused=lambda: self.runner is not None and self.runner.paused,
                               holds_calls=lambda: self.runner is not None and self.runner.gate.paused,
                               current_version=lambda: None if self.runner is None else str(self.runner.version),
                               lora_route=self._lora_route)
        self.store_sizes: dict[str, dict[str, int]] = {}
        """The run's NATS stream and KV buckets: messages and bytes (sampled with the metrics)."""
        self.progress = ProgressWindow(cfg.run.progress_window_s)
        """Counters sampled for the ``health`` block of ``/admin/status`` (:mod:`rollout_service.api.run_health`)."""
        self.loops = LoopSupervisor("the rollout service")
        """Session expiry, engine health, metrics, progress, loop lag (:mod:`asyncrl.loops`)."""
        self.loop_lag = LoopLag()
        self.math_reward: MathReward | None = None
        self.url = url
        """This service's own base URL (given by whoever serves it): the verifiers driver
        reaches its sessions there."""
        self.env_driver = None
        """The verifiers driver's supervisor (``data.source = "verifiers:..."``), else None."""

    @classmethod
    async def create(cls, cfg: RunConfig, url: str | None = None) -> "RolloutService":
        """The service, built (every component constructed with what it needs); ``url``: where
        it will be served, required for a verifiers ``data.source`` (its driver calls it)."""
        svc = cls(cfg, url)
        await svc._build()
        return svc

    async def _build(self) -> None:
        cfg = self.cfg
        if not cfg.engines.urls:
            raise ValueError("engines.urls is empty: give the engines' URLs (asyncrl up starts local engines and passes them)")
        for url in cfg.engines.urls:
            self.pool.add(url)
        tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model.tokenizer_path or cfg.model.path)
        self.tools = CountingTools(ToolRegistry.from_names(cfg.rollout.tools, **tool_options(cfg.rollout)))
        clash = {t.name for t in cfg.rollout.external_tools} & set(self.tools.registry.names)
        if clash:
            raise ValueError(f"external tools {sorted(clash)} have the names of builtin tools")
        self.broker = ExternalBroker({t.name: t for t in cfg.rollout.external_tools}, self._announce,
                                     retention_s=cfg.api.tool_call_retention_s)
        unscoped = sorted({t.environment for t in cfg.rollout.external_tools} - set(cfg.security.environment_tokens))
        if unscoped:
            log.warning("external environments %s list their tool calls to any data-plane client: give each its own "
                        "token in security.environment_tokens (docs/security.md)", unscoped)
        self.chat = ChatTokenizer(tokenizer, self.tools.registry.schemas() + self.broker.schemas())
        self.chats = ChatCache(tokenizer)
        self.inflight_stateless = InflightLimit(cfg.api.max_stateless_requests, "stateless completions")
        self.inflight_polls = InflightLimit(cfg.api.max_long_polls, "tool-call long-polls")
        self.model_name = served_model_name(cfg.api, cfg.model)
        self.math_reward = MathReward()
        self.math_reward.start()
        self.rewards = default_registry(self.math_reward, format_weight=cfg.rollout.format_reward_weight)
        if plays_verifiers(cfg.data):
            from rollout_service.verifiers_env.supervisor import (
                DriverSupervisor,
                build_driver_spec,
                check_config,
            )

            check_config(cfg.data, cfg.rollout)
            if self.url is None:
                raise ValueError("a verifiers data.source needs the service's own URL: RolloutService.create(cfg, url=...)")
            spec = build_driver_spec(cfg, self.url, cfg.derived.max_concurrent_samples)
            self.env_driver = DriverSupervisor(spec, secret(cfg.security.api_token) or "")
        elif cfg.data.source and not cfg.data.train_files:
            self.rewards.register(*await asyncio.to_thread(source_reward, cfg.data))
        stream = await asyncio.to_thread(build_prompt_stream, cfg.data, cfg.rollout, cfg.run_dir, self.chat, self.env_driver)
        password = secret(cfg.security.nats_password)
        url = resolve_nats_url(cfg.nats.url, cfg.run_dir)
        self.nc = await connect(url, f"rollout-{cfg.run.id}", user=cfg.nats.user, password=password)
        js = self.nc.jetstream()
        await ensure_stream(js, StreamSettings.of(cfg))
        agents_kv = await ensure_kv(js, self.names.agents_bucket)
        state_kv = await ensure_kv(js, self.names.state_bucket)
        sessions_bucket = self.names.sessions_bucket
        if self.broker.tools:
            calls_bucket = self.names.calls_bucket
            self.broker.store = KvRecords(await ensure_kv(js, calls_bucket), js, calls_bucket)
        self.sessions = SessionManager(await ensure_kv(js, sessions_bucket), cfg.api.session_ttl_s, cfg.api.max_sessions,
                                       cfg.api.closed_session_retention_s, lambda key: kv_forget(js, sessions_bucket, key))
        keep = 0.0 if cfg.nats.sync_always else cfg.rollout.outbox_keep_acked_s
        outbox = Outbox(Path(cfg.run_dir) / "rollout" / "outbox", cfg.rollout.outbox_max_items, keep)
        record = BoundedJsonl(Path(cfg.run_dir) / "rollout" / "published.jsonl", cfg.rollout.published_record_max_bytes)
        publisher = TrajectoryPublisher(outbox, self.names.trajectories, lambda s, p, h: js.publish(s, p, headers=h), record)
        self.end_of_data = EndOfDataNotice(cfg.run.id, self.names.trajectories, js.publish)

        async def queue_probe() -> int:
            return await self._unconsumed_trajectories(js)

        self.val_records = await asyncio.to_thread(validation_records, cfg.data, cfg.run_dir)
        self.runner = Runner(
            RunnerSettings.from_config(cfg), deps_factory=self._deps, stream=stream, outbox=outbox, publisher=publisher,
            agent_store=AgentStore(agents_kv, js, self.names.agents_bucket), state_store=RunnerStateStore(state_kv), queue_probe=queue_probe,
            abort_engines=self.pool.abort_inflight, rid_prefix=self.rid_prefix,
            validator=self._validation_rollouts if self.val_records else None,
        )

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
                          pause_timeout_s=self.cfg.rollout.pause_timeout_s)

    async def validate(self, version: int | None = None) -> dict:
        """Validate now (at the current version unless given); the result is kept for
        ``/admin/status`` and published as metrics."""
        return await self.runner.validation.run(self.runner.version if version is None else version)

    async def _validation_rollouts(self, version: int) -> dict:
        """Greedy rollouts over the validation set, published as metrics."""
        runner = self.runner
        val_deps = dataclasses.replace(runner.deps, sampling=self.cfg.rollout.val_sampling)
        result = await run_validation(self.val_records, val_deps, self.cfg.run.id, version, runner.max_concurrent)
        await self._publish_metrics(result)
        return result

    async def _publish_metrics(self, doc: dict) -> None:
        try:
            await self.nc.publish(self.names.metrics("rollout"), orjson.dumps({"component": "rollout", "time": time.time(), **doc}))
        except Exception as exc:  # noqa: BLE001 - metrics are best effort
            log.debug("metrics not published: %s", exc)

    def data_played_out(self) -> bool:
        """Every sample of the run's data is played and published, and nothing else is open
        (:mod:`rollout_service.publish.end_of_data`)."""
        r = self.runner
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
        await self._publish_metrics({"kind": "rollout", "version": snap.version, "metrics": verl_metrics(snap)})
        if not self.end_of_data.sent and self.data_played_out():
            await self.end_of_data.send_once(snap.counters.samples_started, snap.counters.trajectories_finished)
        self.store_sizes = await store_sizes(self.nc.jetstream(), self.names)

    async def _observe_progress(self) -> None:
        from rollout_service.api.run_health import progress_counters

        self.progress.observe(progress_counters(self.runner.snapshot()))

    def _deps(self, runner: Runner) -> AgentDeps:
        cfg = self.cfg

        async def reward(state) -> tuple[float, dict]:
            tool_results = [{"name": m.get("name"), "is_error": bool(m.get("is_error"))}
                            for m in state.messages if m.get("role") == "tool"]
            extra = {**state.extra_info, "tool_results": tool_results}
            res = await self.rewards.score(state.data_source, model_text(state, self.chat), state.ground_truth, extra)
            if res.failed:  # the function crashed: not the model's doing, never a learning signal
                state.failure = "reward_error"
            return res.score, dict(res.details)

        return AgentDeps(
            chat=self.chat, generator=runner.calls.routed(self.pool), tools=self.tools, gate=runner.gate,
            parse=PARSERS[cfg.rollout.multi_turn.tool_parser], checkpoint=runner.agent_store.put, reward=reward,
            version_of=weight_version_number, multi_turn=cfg.rollout.multi_turn, sampling=cfg.rollout.sampling,
            response_length=cfg.rollout.response_length, max_model_len=cfg.model.max_model_len,
            rid_prefix=self.rid_prefix, on_tokens=runner.tokens.add,
            external=self.broker if self.broker.tools else None,
        )

    async def _announce(self, environment: str, payload: bytes) -> None:
        await self.nc.publish(self.names.environment(environment), payload)

    async def _expire_sessions(self) -> None:
        for rec in self.sessions.expire_idle():
            await self.sessions.save(rec)
            await self.runner.drop_member(rec.agent.group_id)
        await self.sessions.forget_closed()
        await self.broker.sweep()

    async def _unconsumed_trajectories(self, js) -> int:
        """Trajectories in the stream the trainer has not acknowledged yet."""
        try:
            info = await js.consumer_info(self.names.stream, self.names.trainer_consumer, timeout=1.0)
            pending = int(info.num_pending)
            return pending + int(info.num_ack_pending) - self.end_of_data.unconsumed_share(pending)
        except Exception:  # noqa: BLE001 - no trainer consumer yet: everything stored is unconsumed
            sinfo = await js.stream_info(self.names.stream, subjects_filter=self.names.trajectories)
            stored = int(sinfo.state.messages)
            return stored - self.end_of_data.unconsumed_share(stored)

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
