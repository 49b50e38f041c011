"""Building the rollout service from the run config: every component constructed, with what it
needs given to its constructor, then :class:`~rollout_service.service.RolloutService` around
them (issue 34: one wiring point, constructor injection only).

``build(cfg, url)`` connects to NATS (``nats.url`` or the run's embedded server), ensures the
run's stream and KV buckets, loads the tokenizer, tools, rewards and prompts, opens the outbox
in ``<run dir>/rollout/outbox`` and wires the :class:`Runner`.

No cycle between the runner and the engine pool: the runner routes its agents' calls through
the pool, and what the pool must know of the rollout (paused, calls held, the version served,
the adapter asked for) is a :class:`~rollout_service.serving.ServingState` built first and
given to both (the runner writes it at restore, pause and resume; issue 50). Nothing is built
from the runner either: the agents' dependencies (:class:`AgentWiring`: the generate calls'
count, the gate, the checkpoint store, the token counter) are built before it and given to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

import orjson

from asyncrl.chat import ChatTokenizer
from asyncrl.config import RunConfig, secret
from asyncrl.config.sections_core import ModelConfig
from asyncrl.config.sections_infra import RouterReplayConfig
from asyncrl.jetstream import (
    StreamSettings,
    connect,
    ensure_kv,
    ensure_stream,
    kv_entries,
    kv_forget,
    resolve_nats_url,
)
from asyncrl.jsonl_log import BoundedJsonl
from asyncrl.models import load_tokenizer
from asyncrl.wire import NatsNames
from rollout_service.agent.deps import AgentDeps
from rollout_service.agent.external_tools import ExternalBroker
from rollout_service.agent.routes import RouteShape
from rollout_service.agent.tool_parser import PARSERS
from rollout_service.api.limits import InflightLimit
from rollout_service.engines import EnginePool
from rollout_service.engines.fitness import EngineRequirements
from rollout_service.openai.chat_cache import ChatCache
from rollout_service.openai.handlers import served_model_name
from rollout_service.openai.sessions import SessionManager
from rollout_service.prompts import (
    build_prompt_stream,
    plays_verifiers,
    sessions_only,
    source_reward,
    validation_records,
)
from rollout_service.publish import Outbox, TrajectoryPublisher
from rollout_service.publish.end_of_data import EndOfDataNotice
from rollout_service.rewards import MathReward, default_registry
from rollout_service.runner.accounting import TokenAccounting
from rollout_service.runner.finish import model_text
from rollout_service.runner.inflight import InFlightCalls
from rollout_service.runner.per_request import between_syncs_check
from rollout_service.runner.quota import QueueDepth
from rollout_service.runner.runner import Runner, RunnerSettings
from rollout_service.runner.store import AgentStore, KvRecords, RunnerStateStore
from rollout_service.runner.validation import run_validation
from rollout_service.service import (
    CountingTools,
    RolloutService,
    sandbox_hidden_paths,
    tool_options,
)
from rollout_service.serving import ServingState
from tools.registry import ToolRegistry

log = logging.getLogger(__name__)


async def build(cfg: RunConfig, url: str | None = None) -> RolloutService:
    """The service, every component constructed (module docstring); ``url``: where it will be
    served, required for a verifiers ``data.source`` (its driver calls it). A failure closes
    what was opened (the engines' clients, the reward worker, the NATS connection)."""
    opened: list = []
    try:
        return await _assemble(cfg, url, opened)
    except BaseException:
        for close in reversed(opened):
            done = close()
            if asyncio.iscoroutine(done):
                await done
        raise


async def _assemble(cfg: RunConfig, url: str | None, opened: list) -> RolloutService:
    if not cfg.engines.urls:
        raise ValueError("engines.urls is empty: give the engines' URLs (asyncrl up starts local engines and passes them)")
    names, rid_prefix = NatsNames(cfg.run.id), f"rl-{cfg.run.id}."
    serving = ServingState(cfg.run.id, cfg.syncs_adapters)  # module docstring: shared, the runner writes it
    e = cfg.engines
    pool = EnginePool(api_key=secret(e.api_key), admin_api_key=secret(e.admin_api_key), request_timeout_s=e.request_timeout_s,
                      control_timeout_s=e.control_timeout_s, request_timeout_floor_s=e.request_timeout_floor_s,
                      min_decode_tokens_per_s=e.min_decode_tokens_per_s, serving=serving, requirements=EngineRequirements.of(cfg.actor))
    opened.append(pool.close)
    for engine_url in e.urls:
        pool.add(engine_url)
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model.tokenizer_path or cfg.model.path)
    tools = CountingTools(ToolRegistry.from_names(cfg.rollout.tools, **tool_options(cfg.rollout, sandbox_hidden_paths(cfg.run_dir, cfg.data))))
    clash = {t.name for t in cfg.rollout.external_tools} & set(tools.registry.names)
    if clash:
        raise ValueError(f"external tools {sorted(clash)} have the names of builtin tools")
    unscoped = sorted({t.environment for t in cfg.rollout.external_tools} - set(cfg.security.environment_tokens))
    if unscoped:
        log.warning("external environments %s list their tool calls to any data-plane client: give each its own "
                    "token in security.environment_tokens (docs/security.md)", unscoped)
    math_reward = MathReward()
    math_reward.start()
    opened.append(math_reward.close)
    rewards = default_registry(math_reward, format_weight=cfg.rollout.format_reward_weight)
    env_driver = None
    if plays_verifiers(cfg.data):
        from rollout_service.verifiers_env.supervisor import (
            DriverSupervisor,
            build_driver_spec,
            check_config,
        )

        check_config(cfg.data, cfg.rollout)
        if url is None:
            raise ValueError("a verifiers data.source needs the service's own URL: build(cfg, url=...)")
        env_driver = DriverSupervisor(build_driver_spec(cfg, url, cfg.derived.max_concurrent_samples),
                                      secret(cfg.security.api_token) or "")
    elif cfg.data.source and not cfg.data.train_files and not sessions_only(cfg.data):
        rewards.register(*await asyncio.to_thread(source_reward, cfg.data))

    nc = await connect(resolve_nats_url(cfg.nats.url, cfg.run_dir), f"rollout-{cfg.run.id}", user=cfg.nats.user,
                       password=secret(cfg.security.nats_password))
    opened.append(nc.close)
    js = nc.jetstream()
    await ensure_stream(js, StreamSettings.of(cfg))
    calls_store = None
    if cfg.rollout.external_tools:
        calls_store = KvRecords(await ensure_kv(js, names.calls_bucket), js, names.calls_bucket)

    async def announce(environment: str, payload: bytes) -> None:
        await nc.publish(names.environment(environment), payload)

    broker = ExternalBroker({t.name: t for t in cfg.rollout.external_tools}, announce, calls_store,
                            retention_s=cfg.api.tool_call_retention_s)
    chat = ChatTokenizer(tokenizer, tools.registry.schemas() + broker.schemas())
    stream = await asyncio.to_thread(build_prompt_stream, cfg.data, cfg.rollout, cfg.run_dir, chat, env_driver)
    sessions_bucket = names.sessions_bucket
    sessions = SessionManager(await ensure_kv(js, sessions_bucket), cfg.api.session_ttl_s, cfg.api.max_sessions,
                              cfg.api.closed_session_retention_s, lambda key: kv_forget(js, sessions_bucket, key),
                              lambda: kv_entries(js, sessions_bucket))
    keep = 0.0 if cfg.nats.sync_always else cfg.rollout.outbox_keep_acked_s
    outbox = Outbox(Path(cfg.run_dir) / "rollout" / "outbox", cfg.rollout.outbox_max_items, keep)
    record = BoundedJsonl(Path(cfg.run_dir) / "rollout" / "published.jsonl", cfg.rollout.published_record_max_bytes)
    publisher = TrajectoryPublisher(outbox, names.trajectories, lambda s, p, h: js.publish(s, p, headers=h), record)
    end_of_data = EndOfDataNotice(cfg.run.id, names.trajectories, js.publish)

    async def queue_probe() -> QueueDepth:
        return await queue_depth(js, names, end_of_data)

    async def publish_metrics(doc: dict) -> None:
        try:
            await nc.publish(names.metrics("rollout"), orjson.dumps({"component": "rollout", "time": time.time(), **doc}))
        except Exception as exc:  # noqa: BLE001 - metrics are best effort
            log.debug("metrics not published: %s", exc)

    val_records = await asyncio.to_thread(validation_records, cfg.data, cfg.run_dir)

    calls, tokens = InFlightCalls(lambda: serving.version), TokenAccounting()
    agent_store = AgentStore(await ensure_kv(js, names.agents_bucket), js, names.agents_bucket)
    settings = RunnerSettings.from_config(cfg)
    deps = build_agent_deps(cfg, AgentWiring(generator=calls.routed(pool), gate=serving.gate, checkpoint=agent_store.put,
                                             on_tokens=tokens.add), chat, tools, broker, rewards, rid_prefix)
    deps = dataclasses.replace(deps, stale_check=between_syncs_check(settings.request_rule, calls, serving,
                                                                    cfg.sync.per_request.project_versions))

    async def validation_rollouts(version: int) -> dict:
        """Greedy rollouts over the validation set, published as metrics."""
        val_deps = dataclasses.replace(deps, sampling=cfg.rollout.val_sampling, stale_check=lambda state, budget: "")  # never trained
        result = await run_validation(val_records, val_deps, cfg.run.id, version, settings.max_concurrent_samples)
        await publish_metrics(result)
        return result

    runner = Runner(
        settings, deps=deps, stream=stream, outbox=outbox, publisher=publisher, agent_store=agent_store,
        state_store=RunnerStateStore(await ensure_kv(js, names.state_bucket)), queue_probe=queue_probe,
        abort_engines=pool.abort_inflight, rid_prefix=rid_prefix, validator=validation_rollouts if val_records else None,
        serving=serving, calls=calls, tokens=tokens, abort_rids=pool.abort_rids,
    )
    return RolloutService(
        cfg, url=url, nc=nc, names=names, pool=pool, runner=runner, tools=tools, broker=broker, chats=ChatCache(tokenizer),
        sessions=sessions, model_name=served_model_name(cfg.api, cfg.model), math_reward=math_reward, env_driver=env_driver,
        end_of_data=end_of_data, publish_metrics=publish_metrics,
        inflight_stateless=InflightLimit(cfg.api.max_stateless_requests, "stateless completions"),
        inflight_polls=InflightLimit(cfg.api.max_long_polls, "tool-call long-polls"),
    )


@dataclasses.dataclass(frozen=True)
class AgentWiring:
    """What the agents share with the runner, built before both: the engines through the
    call count, the pause gate, the checkpoint store, the token counter."""

    generator: object
    gate: object
    checkpoint: object
    on_tokens: object


def build_agent_deps(cfg: RunConfig, wiring: AgentWiring, chat: ChatTokenizer, tools: CountingTools,
                     broker: ExternalBroker, rewards, rid_prefix: str) -> AgentDeps:
    """What the runner's agents run with: ``wiring``, the tools, the reward registry (a reward
    function that crashed marks the trajectory ``reward_error``: never a learning signal)."""

    async def reward(state) -> tuple[float, dict]:
        tool_results = [{"name": m.get("name"), "is_error": bool(m.get("is_error"))}
                        for m in state.messages if m.get("role") == "tool"]
        extra = {**state.extra_info, "tool_results": tool_results}
        res = await rewards.score(state.data_source, model_text(state, chat), state.ground_truth, extra)
        if res.failed:
            state.failure = "reward_error"
        return res.score, dict(res.details)

    return AgentDeps(
        chat=chat, generator=wiring.generator, tools=tools, gate=wiring.gate,
        parse=PARSERS[cfg.rollout.multi_turn.tool_parser], checkpoint=wiring.checkpoint, reward=reward,
        multi_turn=cfg.rollout.multi_turn, sampling=cfg.rollout.sampling,
        response_length=cfg.rollout.response_length, max_model_len=cfg.model.max_model_len,
        rid_prefix=rid_prefix, on_tokens=wiring.on_tokens, external=broker if broker.tools else None,
        routes=route_shape(cfg.actor.router_replay, cfg.model),
    )


def route_shape(replay: RouterReplayConfig, model: ModelConfig) -> RouteShape | None:
    """The policy's routing when the run replays routes (``actor.router_replay.mode = "R3"``);
    a dense model is refused then (ValueError: the service does not start)."""
    if replay.mode != "R3":
        return None
    from asyncrl.models import load_config as load_model_config

    return RouteShape.of(load_model_config(model.path))


async def queue_depth(js, names: NatsNames, end_of_data: EndOfDataNotice) -> QueueDepth:
    """:func:`unconsumed_trajectories`, and what the trainer holds (delivered, not yet acked: the
    part of a step it assembles or the step it trains; 0 without a trainer consumer)."""
    try:
        info = await js.consumer_info(names.stream, names.trainer_consumer, timeout=1.0)
    except Exception:  # noqa: BLE001 - no trainer consumer yet: everything stored is unconsumed
        sinfo = await js.stream_info(names.stream, subjects_filter=names.trajectories)
        stored = int(sinfo.state.messages)
        return QueueDepth(stored - end_of_data.unconsumed_share(stored), 0)
    pending = int(info.num_pending)
    return QueueDepth(pending - end_of_data.unconsumed_share(pending), int(info.num_ack_pending))


async def unconsumed_trajectories(js, names: NatsNames, end_of_data: EndOfDataNotice) -> int:
    """Trajectories in the stream not yet delivered to the trainer: verl's message-queue size,
    what the staleness quota counts as queued. What the trainer already holds (its consumer's
    ``num_ack_pending``: the part of a step it is still assembling, or the step it trains) is
    not counted: it is trained without any new sample. Counting it held the quota shut while
    the trainer waited for the rest of its step, for good (seen after a crash of the trainer
    and the rollout: 11 "stale" samples of which 3 were the trainer's half step)."""
    try:
        info = await js.consumer_info(names.stream, names.trainer_consumer, timeout=1.0)
        pending = int(info.num_pending)
        return pending - end_of_data.unconsumed_share(pending)
    except Exception:  # noqa: BLE001 - no trainer consumer yet: everything stored is unconsumed
        sinfo = await js.stream_info(names.stream, subjects_filter=names.trajectories)
        stored = int(sinfo.state.messages)
        return stored - end_of_data.unconsumed_share(stored)
