"""Config sections of the inference engines: where they are (``engines``) and the settings of
the CPU engines ``asyncrl up`` starts itself (``engines.local``, ``engines.local.timing``).

``LocalEngineSection`` is the one definition of local_engine's tunable settings:
``local_engine.settings.EngineSettings`` extends it with what identifies one process (model,
port, seed, keys), and local_engine's command line is derived from those fields
(``EngineSettings.to_argv`` / ``from_argv``: field ``max_batch_size`` is flag
``--max-batch-size``, ``timing.decode_ms`` is ``--timing-decode-ms``). Which SGLang release
``sglang_compat`` may name is local_engine's knowledge: it is checked when an engine's
settings are built (``asyncrl up`` does that before starting any engine).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from asyncrl.config.sections_core import Section
from asyncrl.engine_urls import allowed_entry_problem, url_shape_problem


class TimingSection(Section):
    enabled: bool = Field(False, json_schema_extra={"flag": "--timing-mode"})
    """Timing mode: the engine computes nothing and only takes time (for system benchmarks;
    see ``local_engine.simulated``): each decode step sleeps ``decode_ms`` and each row draws
    a long-tailed response length. The seed is the engine's."""
    decode_ms: float = Field(20.0, ge=0.0, le=60_000.0)
    """Latency of one batched decode step (ms)."""
    prefill_ms_per_token: float = Field(0.05, ge=0.0, le=1000.0)
    """Prefill latency per prompt token (ms)."""
    length_median: float = Field(200.0, gt=0.0, le=1_048_576.0)
    """Median response length (tokens) of the log-normal draw."""
    length_sigma: float = Field(1.0, ge=0.0, le=10.0)
    """Log-normal sigma of the response length: the weight of the tail."""
    length_max: int = Field(4096, ge=1, le=1_048_576)
    """Longest response drawn (tokens)."""
    tool_call: str | None = Field(None, max_length=4096)
    """Text (tokenized by the engine's tokenizer) that ends a response, before the end of
    sequence, while its context holds fewer than ``tool_turns`` copies of it: multi-turn,
    tool-calling trajectories without a model, e.g. a hermes ``<tool_call>`` block for the
    calculator. None: every response is filler only."""
    tool_turns: int = Field(0, ge=0, le=1024)
    """Responses per trajectory that end with ``tool_call`` (the next one answers plainly)."""


class LocalEngineSection(Section):
    max_batch_size: int = Field(32, ge=1, le=4096)
    """Most requests decoded together in one step; the rest wait in the queue."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the model runs. Weight-update groups are gloo (CPU) either way."""
    torch_threads: int = Field(1, ge=0, le=1024)
    """torch intra-op threads (0: torch's default). 1 because with the trainer or other
    engines on the same cores, OpenMP's spinning made a tiny-model decode step 10x slower
    with 2 threads than with 1 (measured on 2 cores)."""
    weight_sync_timeout_s: float = Field(300.0, gt=0.0)
    """Limit of forming a weight group and of each bucket's broadcasts (RELIABILITY T_sync)."""
    pause_drain_timeout_s: float = Field(30.0, gt=0.0)
    """pause(mode=abort): how long to keep aborting until no /generate is in flight."""
    sglang_compat: str | None = None
    """The SGLang release whose protocol behaviour to copy (see ``local_engine.compat``).
    None: the newest release local_engine emulates."""
    tp_size: int = Field(1, ge=1, le=64)
    """Tensor-parallel workers to act as: the engine joins a weight-update group as ranks
    ``rank_offset .. rank_offset + tp_size - 1`` (one gloo member each), as SGLang does. The
    model itself runs once; only the group membership is multiplied."""
    dp_size: int = Field(1, ge=1, le=64)
    """Reported in /server_info; weight-update routes refuse it the way SGLang does."""
    pp_size: int = Field(1, ge=1, le=64)
    """Reported in /server_info; weight-update groups refuse pp_size > 1."""
    enable_dp_attention: bool = False
    """Reported in /server_info (older SGLang accepts dp_size > 1 with it)."""
    disable_radix_cache: bool = False
    """SGLang's ``--disable-radix-cache``. Off (SGLang's default): a request that ends by an abort
    while running leaves its KV in a prefix cache, and a later prefill whose context starts with
    those tokens reuses that KV (``cached_tokens``) whatever the weights now, until a cache
    flush (:mod:`local_engine.prefix_cache`). ``in_place`` syncs need it on."""
    disable_overlap_schedule: bool = False
    """SGLang's ``--disable-overlap-schedule``. Off (SGLang's default): the token of the step
    before an ``in_place`` pause is still pending at the pause, so a weight update meanwhile
    labels it with the new version (``weight_versions``), as SGLang's overlap scheduler does.
    ``in_place`` syncs need it on."""
    enable_deterministic_inference: bool = False
    """SGLang's ``--enable-deterministic-inference``. Only with it does SGLang honour a request's
    ``sampling_seed`` (an OpenAI ``seed``), and a request without one is then seeded with 42;
    off (SGLang's default), ``sampling_seed`` is accepted and ignored. local_engine does the
    same (its batches are batch-invariant either way)."""
    health_generation: bool = True
    """SGLang's ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``: ``/health`` behaves like
    ``/health_generate`` (waits behind a pause) unless false."""
    health_check_timeout_s: float = Field(20.0, gt=0.0)
    """SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT``: ``/health_generate`` answers 503 after this."""
    timing: TimingSection = Field(default_factory=TimingSection)
    """Timing mode (no model compute)."""


class EnginesConfig(Section):
    backend: Literal["local", "sglang"] = "local"
    """``local``: local_engine processes (started by ``asyncrl up`` when ``urls`` is empty).
    ``sglang``: SGLang engines at ``urls``. Also decides the default
    ``trainer.weight_sync_backend`` (local engines join gloo groups only)."""
    urls: list[str] = Field(default_factory=list)
    """Base URLs of running engines (SGLang, or local engines started elsewhere)."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """Where an engine added at run time (``POST /admin/engines``) may be, besides the
    endpoints of ``urls`` (their host and port): ``host:port`` (``[v6]:port``) for one
    endpoint, a host name or address for any port of it, or a network in CIDR form
    (``10.0.0.0/24``) for any port of its addresses. The engine keys go to every engine the
    services know (:mod:`asyncrl.engine_urls`)."""
    num_local: int = Field(1, ge=0, le=64)
    """Local engines ``asyncrl up`` starts when ``backend`` is ``local`` and ``urls`` is empty."""
    local: LocalEngineSection = Field(default_factory=LocalEngineSection)
    """Settings of each local engine ``asyncrl up`` starts (the model, seed, dtype and
    ``max_model_len`` come from the ``model`` section, the log settings from ``run``)."""
    gpus_per_engine: int = Field(1, ge=1, le=64)
    """GPUs of each SGLang engine (its ``--tp-size``; compose's GPU slots). The weight-update
    group's ranks are not taken from here: each engine's ``/server_info`` says them."""
    api_key: SecretStr | None = None
    """Bearer token the engines require (SGLang ``--api-key``)."""
    admin_api_key: SecretStr | None = None
    """Bearer token of the engines' admin routes (SGLang ``--admin-api-key``: pause, abort, weights)."""
    request_timeout_s: float | None = Field(None, gt=0.0)
    """Upper bound of one /generate call. None: derived per call from what it asks for,
    ``request_timeout_floor_s + max_new_tokens / min_decode_tokens_per_s`` (a short turn fails
    fast on an engine that never finishes it; a 32k-token response is not cut at a fixed
    10 minutes). A hung engine's calls do not wait for it either way: they are taken back
    when its health probe fails (docs/rollout_service.md, Engines)."""
    request_timeout_floor_s: float = Field(60.0, gt=0.0)
    """The derived timeout's fixed part: queueing and prefill before the first token."""
    min_decode_tokens_per_s: float = Field(2.0, gt=0.0)
    """The slowest decode rate one request is allowed before its call times out (derived
    timeout); set it well below what a loaded engine gives one request."""
    control_timeout_s: float = Field(60.0, gt=0.0)
    """Upper bound of control calls (pause, abort, flush, info)."""
    weight_group_timeout_s: float | None = Field(None, gt=0.0, le=86400.0)
    """Timeout of an SGLang engine's side of the weight-update group (each broadcast it waits
    in). SGLang sets none, so torch's 30 minutes apply: over NCCL an engine downstream of a
    stalled rank would stay paused that long (docs/operations.md, "Which weight-sync backend").
    The SGLang engines asyncrl starts (``asyncrl slurm``; compose's ``ENGINE_WEIGHT_GROUP_TIMEOUT_S``)
    get it through asyncrl's hook (``launcher/sglang_hooks``); hand-started ones as
    docs/deployment.md shows. None: ``sync.broadcast_timeout_s`` + 60 s (360 s by default;
    ``RunConfig.engine_weight_group_timeout_s``); set, it must exceed ``sync.broadcast_timeout_s``:
    a healthy sync's engine waits at most that long for the trainer's next bucket. The cost of a timeout over
    NCCL: with torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` the engine process exits and
    is restarted, then repaired to the current weights. Local engines: ``local.weight_sync_timeout_s``."""

    @field_validator("urls")
    @classmethod
    def _urls_are_http(cls, v: list[str]) -> list[str]:
        for url in v:
            if not re.match(r"^https?://[^/\s]+", url):
                raise ValueError(f"engine url {url!r} must start with http:// or https://")
            problem = url_shape_problem(url)
            if problem:
                raise ValueError(problem)
        return [u.rstrip("/") for u in v]

    @field_validator("allowed_hosts")
    @classmethod
    def _allowed_hosts_parse(cls, v: list[str]) -> list[str]:
        for entry in v:
            problem = allowed_entry_problem(entry)
            if problem:
                raise ValueError(problem)
        return v
