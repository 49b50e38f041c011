"""The run config: one typed document shared by every component, and its derived numbers.

``RunConfig`` is what every process receives (from a file, ``section.key=value`` arguments
and ``ASYNCRL_SECTION__KEY`` variables, see :mod:`asyncrl.config.loader`).
``DerivedNumbers`` computes, in one place, the quantities verl derives from the knobs.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

from pydantic import BaseModel, Field, model_validator

from asyncrl.config.sections_core import (
    ApiConfig,
    AsyncTrainingConfig,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    Section,
)
from asyncrl.config.sections_engines import EnginesConfig
from asyncrl.config.sections_infra import (
    ActorConfig,
    NatsConfig,
    RunSection,
    SecurityConfig,
    SyncConfig,
    TrainerConfig,
)
from asyncrl.config.sections_slurm import SlurmConfig

CONCURRENT_PER_ENGINE = 16  # verl: max_concurrent_samples = len(server_handles) * 16
WIRE_BYTES_PER_TOKEN_BOUND = 24  # msgpack: token id <=5 B, logprob 9 B, version <=5 B, mask 1 B
DEBUG_TEXT_BYTES_PER_TOKEN = 16  # optional `messages` text: worst-case UTF-8 bytes per token
WIRE_FIXED_OVERHEAD = 1 << 20  # headers, reward details, timings, metadata


WEIGHT_GROUP_SLACK_S = 60.0
"""How much longer than ``sync.broadcast_timeout_s`` an SGLang engine waits in the weight group by default."""


class RunConfig(Section):
    """Everything a run needs; each section documents its fields."""

    run: RunSection = Field(default_factory=RunSection)
    """Run identity and directory."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training and validation prompts."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """The rollout service and its agents."""
    async_training: AsyncTrainingConfig = Field(default_factory=AsyncTrainingConfig)
    """verl's fully-async knobs."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """The policy-gradient algorithm."""
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    """Inference engines."""
    nats: NatsConfig = Field(default_factory=NatsConfig)
    """NATS JetStream."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Trainer processes and checkpoints."""
    sync: SyncConfig = Field(default_factory=SyncConfig)
    """The sync agent."""
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    """Tokens."""
    api: ApiConfig = Field(default_factory=ApiConfig)
    """The OpenAI-compatible API and sessions of the rollout service."""
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    """``asyncrl slurm``: the allocation and the placement on it."""

    @model_validator(mode="after")
    def _adapter_syncs_abort_what_is_in_flight(self) -> RunConfig:
        if (self.actor.lora_rank and self.sync.lora_weights == "adapter" and self.async_training.partial_rollout_active
                and self.sync.pause_policy != "abort"):
            raise ValueError(f"sync.lora_weights=adapter needs sync.pause_policy=abort with partial rollout (got "
                             f"{self.sync.pause_policy}): a request kept across an adapter sync goes on with the adapter "
                             f"it started with; abort resends it on the new one. Or set sync.lora_weights=merged")
        return self

    @model_validator(mode="after")
    def _lora_merges_on_the_host(self) -> RunConfig:
        if self.actor.lora_rank and self.sync.lora_weights == "merged" and self.sync.staging in ("buckets", "two_buckets"):
            raise ValueError(f"actor.lora_rank={self.actor.lora_rank} needs sync.staging=auto or state_dict: the adapters "
                             f"are merged into the weights the engines get from the full state dict, not from "
                             f"sync.staging={self.sync.staging}'s buckets")
        return self

    @model_validator(mode="after")
    def _engines_wait_out_a_healthy_broadcast(self) -> RunConfig:
        if self.engines.weight_group_timeout_s is not None and self.engines.weight_group_timeout_s <= self.sync.broadcast_timeout_s:
            raise ValueError(f"engines.weight_group_timeout_s ({self.engines.weight_group_timeout_s:g}) must exceed "
                             f"sync.broadcast_timeout_s ({self.sync.broadcast_timeout_s:g}): an engine may wait that long "
                             f"for the trainer's next bucket in a healthy sync")
        return self

    @model_validator(mode="after")
    def _token_budget_holds_a_trajectory(self) -> RunConfig:
        a = self.actor
        if a.use_dynamic_bsz and a.ppo_max_token_len_per_gpu < self.model.max_model_len:
            raise ValueError(f"actor.ppo_max_token_len_per_gpu ({a.ppo_max_token_len_per_gpu}) must be >= model.max_model_len "
                             f"({self.model.max_model_len}): a trajectory that long would fit no micro-batch")
        return self

    @property
    def engine_weight_group_timeout_s(self) -> float:
        """``engines.weight_group_timeout_s``, or ``sync.broadcast_timeout_s`` + 60 s when unset."""
        e = self.engines.weight_group_timeout_s
        return e if e is not None else self.sync.broadcast_timeout_s + WEIGHT_GROUP_SLACK_S

    @property
    def syncs_adapters(self) -> bool:
        """Syncs send the LoRA adapter alone (``actor.lora_rank > 0``, ``sync.lora_weights = adapter``)."""
        return bool(self.actor.lora_rank) and self.sync.lora_weights == "adapter"

    @property
    def run_dir(self) -> Path:
        """The run directory with ``{id}`` substituted."""
        return Path(self.run.dir.format(id=self.run.id))

    @property
    def derived(self) -> "DerivedNumbers":
        """verl's derived numbers for this config."""
        return DerivedNumbers.of(self)


class DerivedNumbers(BaseModel):
    """Numbers verl derives from the knobs (names as in verl's fully_async_policy).

    ``required_samples``: samples per trainer update (``ppo_mini_batch_size *
    require_batches``). ``max_required_samples``: samples the rollout may start between two
    syncs before stale ones are subtracted, ``required_samples * trigger_parameter_sync_step
    * (1 + staleness_threshold)`` (floored). ``max_concurrent_samples``: trajectories in flight.
    ``max_queue_size``: verl's MessageQueue bound, equal to ``max_required_samples``.
    """

    num_engines: int
    required_samples: int
    required_trajectories: int
    samples_per_sync: int
    max_required_samples: int
    max_concurrent_samples: int
    max_queue_size: int
    total_updates: int | None
    total_syncs: int | None
    max_message_bytes: int
    max_version_lag: int
    """How many versions older than the trainer's a trained trajectory may be, by the run's
    ``staleness_age`` (:func:`max_version_lag`: ``ceil(staleness_threshold)``, +1 with partial
    rollout); beyond it the trainer drops or down-weights it (``stale_policy``)."""
    stale_cancel_lag: int | None
    """``max_version_lag`` when a call lagging more is certain to be dropped (``stale_policy =
    "drop"`` with ``staleness_age = "oldest"``) and ``sync.per_request.cancel_stale`` is on under
    ``pause_policy = "per_request"``; None: nothing is cancelled for staleness."""

    @classmethod
    def of(cls, cfg: RunConfig) -> "DerivedNumbers":
        at = cfg.async_training
        if cfg.engines.backend == "local" and not cfg.engines.urls:
            num_engines = cfg.engines.num_local
        else:
            num_engines = len(cfg.engines.urls)
        required = cfg.actor.ppo_mini_batch_size * at.require_batches
        per_sync = required * at.trigger_parameter_sync_step
        max_required = math.floor(per_sync * (1.0 + at.staleness_threshold) + 1e-9)
        concurrent = cfg.rollout.max_concurrent or max(1, num_engines) * CONCURRENT_PER_ENGINE
        total = cfg.rollout.total_rollout_steps
        max_tokens = cfg.model.max_model_len
        lag = max_version_lag(at.staleness_threshold, 1 if at.partial_rollout_active else 0)
        cancels = (cfg.sync.pause_policy == "per_request" and cfg.sync.per_request.cancel_stale
                   and at.stale_policy == "drop" and at.staleness_age == "oldest")
        routes = route_bytes_per_token(cfg.model.path) if cfg.actor.router_replay.mode == "R3" else 0
        return cls(
            num_engines=num_engines,
            required_samples=required,
            required_trajectories=required * cfg.rollout.n,
            samples_per_sync=per_sync,
            max_required_samples=max_required,
            max_concurrent_samples=concurrent,
            max_queue_size=max_required,
            total_updates=None if total is None else total // required,
            total_syncs=None if total is None else total // per_sync,
            max_message_bytes=max_tokens * (WIRE_BYTES_PER_TOKEN_BOUND + DEBUG_TEXT_BYTES_PER_TOKEN + routes)
            + WIRE_FIXED_OVERHEAD,
            max_version_lag=lag,
            stale_cancel_lag=lag if cancels else None,
        )


ROUTE_BYTES_FALLBACK = 1024
"""Route bytes per token assumed when the model's config cannot be read where the bound is
computed (64 layers x 8 experts x 2-byte ids)."""


def route_bytes_per_token(model_path: str) -> int:
    """What routing replay adds to a trajectory per token on the wire: layers x experts per
    token x bytes per expert id (:mod:`asyncrl.wire.routed_experts`); 0 for a dense model (R3
    refuses it elsewhere); :data:`ROUTE_BYTES_FALLBACK` when the model's config cannot be read
    here (not cached: a later call may read it)."""
    try:
        return _route_bytes(model_path)
    except Exception:  # noqa: BLE001 - any unreadable config: the bound falls back, the run's own checks report it
        return ROUTE_BYTES_FALLBACK


@functools.lru_cache(maxsize=16)
def _route_bytes(model_path: str) -> int:
    """From the model's ``config.json`` read as JSON (a directory), or a built-in's config built in
    code; never a download or a conversion (a config is all the bound needs)."""
    import json

    from asyncrl.models import BUILT_IN_CODE
    from asyncrl.wire.routed_experts import width_for

    if model_path in BUILT_IN_CODE:
        fields = BUILT_IN_CODE[model_path]().to_dict()
    else:
        fields = json.loads((Path(model_path).expanduser() / "config.json").read_text())
        fields = fields.get("text_config", fields)
    top_k = fields.get("num_experts_per_tok")
    experts = fields.get("num_experts") or fields.get("num_local_experts") or fields.get("n_routed_experts")
    if not top_k or not experts:
        return 0
    return int(fields["num_hidden_layers"]) * int(top_k) * width_for(int(experts))


def max_version_lag(staleness_threshold: float, slack: int = 0) -> int:
    """``ceil(staleness_threshold) + slack``: between two syncs the rollout starts at most
    ``(1 + s) N`` samples for ``N`` consumed, so without partial rollouts a sample is consumed at
    most ``ceil(s)`` versions after the one that generated it; a partial trajectory's first
    tokens can be one more sync older (``slack = 1`` with partial rollout)."""
    if staleness_threshold < 0 or slack < 0:
        raise ValueError("staleness_threshold and slack must be >= 0")
    return math.ceil(staleness_threshold) + slack
