"""Config sections for the trainer's algorithm, NATS, the trainer processes, the sync agent,
security and the run itself (the engines' sections: :mod:`asyncrl.config.sections_engines`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator

from asyncrl.config.sections_core import Section

STANDALONE_SYNC_PORT = 8100
"""``sync.port`` unset: the sync agent started alone binds this (``asyncrl up`` draws one)."""
STANDALONE_METRICS_PORT = 9400
"""``trainer.metrics_port`` unset: trainer rank 0 started alone serves Prometheus here."""
RUN_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,47}$"


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """AdamW decoupled weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps of the learning rate."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up (cosine decays to 0 at ``trainer.total_training_steps``)."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class RouterReplayConfig(Section):
    mode: Literal["disabled", "R3"] = "disabled"
    """Mixture-of-experts routing replay (verl's ``actor.router_replay.mode``). ``R3``: the
    engines return the experts each token was routed to (SGLang's
    ``--enable-return-routed-experts``; local engines get it from asyncrl), each token keeps the
    routes of the call that first computed it, and the trainer's forward takes those experts
    while the routing weights still come from its own router logits (the router keeps its
    gradient). Needs an MoE model; a trajectory without its routes is refused. ``disabled``:
    the trainer routes on its own (its experts may differ from those that sampled the
    tokens). verl's ``R2`` (replaying the trainer's own old-policy routes) is not offered: the
    old log-probs here are the rollout's."""


class ActorConfig(Section):
    ppo_mini_batch_size: int = Field(4, ge=1, le=1_000_000)
    """Samples (prompts, each with ``rollout.n`` trajectories) per optimiser update, global
    across data-parallel ranks (verl's meaning)."""
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1, le=100_000)
    """Trajectories per forward/backward on one rank (gradient accumulation below it)."""
    ppo_epochs: int = Field(1, ge=1, le=100)
    """Passes over each mini-batch."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimiser."""
    clip_ratio_low: float = Field(0.2, ge=0.0, lt=1.0)
    """PPO lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = Field(0.28, ge=0.0, le=10.0)
    """PPO upper clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher uses 0.28)."""
    clip_ratio_c: float | None = Field(3.0, gt=1.0)
    """Dual-clip constant for negative advantages (None disables dual clip)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """Loss aggregation (verl's names): token-mean is DAPO's token-level loss."""
    loss_scale_factor: float | None = Field(None, gt=0.0)
    """verl: the constant ``C`` that ``seq-mean-token-sum-norm`` divides each sequence's token
    sum by. None: the padded response length of the micro-batch."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group's reward std (Dr. GRPO sets this False)."""
    filter_zero_variance_groups: bool = False
    """Drop groups whose rewards are all equal (no learning signal; DAPO's dynamic sampling)."""
    tis_imp_ratio_cap: float | None = Field(2.0, gt=0.0)
    """Truncated importance sampling (TIS): weight by min(pi_old/pi_rollout, cap), at
    ``rollout_is_level``, to correct the rollout/trainer mismatch. None: no truncation (with
    ``rollout_rs`` set, the raw ratio weights the kept tokens: MIS/IcePop), and no weight at
    all when ``rollout_rs`` is None too. Applies when the ratio is anchored at recomputed
    log-probs (``async_training.compute_prox_log_prob`` or ``use_rollout_log_probs=false``)."""
    rollout_is_level: Literal["token", "sequence"] = "token"
    """Level of the IS weight: per token, or one weight per sequence (product of its token ratios)."""
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    """Masked IS / rejection: weight 0 for tokens (or whole sequences; ``geometric``: by the
    sequence's mean log-ratio) whose ratio lies outside [rollout_rs_threshold_lower,
    rollout_rs_threshold]. ``token`` with both bounds is IcePop. None: no masking."""
    rollout_rs_threshold: float = Field(2.0, gt=1.0)
    """Upper bound of the ratio kept by ``rollout_rs``."""
    rollout_rs_threshold_lower: float | None = Field(None, gt=0.0, lt=1.0)
    """Lower bound kept by ``rollout_rs``. None: 1 / rollout_rs_threshold."""
    loss_mode: Literal["vanilla", "gspo", "cispo"] = "vanilla"
    """Policy loss (verl's ``policy_loss.loss_mode``): PPO clip, GSPO (sequence ratios), CISPO
    (clipped, detached IS weight on log-probs). docs/algorithms.md."""
    adv_estimator: Literal["grpo", "rloo"] = "grpo"
    """Outcome advantage (verl's ``algorithm.adv_estimator``): GRPO (group mean baseline, std
    normalisation by ``norm_adv_by_std_in_grpo``) or RLOO (leave-one-out mean baseline)."""
    truncated_sampling: Literal["train", "drop"] = "train"
    """Trajectories with tokens sampled under top-p < 1, top-k > 0 or min-p > 0 whose behaviour
    log-probs the engine did not report (it does with a ``top_k`` of at most 1024 on SGLang
    0.5.16+): their logprobs are of the untruncated distribution, so the IS ratio ignores the
    truncation. ``train`` trains them (counted as ``trainer/truncated_sampling_trajectories``),
    ``drop`` excludes them (reason ``truncated_sampling``). docs/algorithms.md, "What is trained"."""
    use_kl_loss: bool = False
    """Add a KL penalty to a frozen reference model."""
    kl_loss_coef: float = Field(0.001, ge=0.0)
    """Coefficient of the KL penalty."""
    kl_loss_type: Literal["kl", "abs", "mse", "low_var_kl"] = "low_var_kl"
    """KL estimator (verl's names)."""
    entropy_coeff: float = Field(0.0, ge=0.0)
    """Entropy bonus coefficient."""
    calculate_entropy: bool = False
    """Report ``actor/entropy`` even when ``entropy_coeff`` is 0 (verl's name): one extra
    no-grad pass over the vocabulary per micro-batch (~8 % of a step on builtin:tiny). With
    ``entropy_coeff != 0`` the entropy is in the loss and always reported."""
    activation_checkpointing: bool = False
    """Recompute decoder-block activations in backward to save memory."""
    use_remove_padding: bool = True
    """Pack each micro-batch's trajectories end to end in one row, attention kept inside each
    (verl's name): no padding is processed. False: right-padded rows (the reference path)."""
    use_dynamic_bsz: bool = False
    """Micro-batches hold up to ``ppo_max_token_len_per_gpu`` tokens instead of
    ``ppo_micro_batch_size_per_gpu`` trajectories (verl's name)."""
    ppo_max_token_len_per_gpu: int = Field(16384, ge=16, le=16_777_216)
    """Token budget of one micro-batch with ``use_dynamic_bsz`` (prompt + response tokens);
    must hold ``model.max_model_len`` (a longer trajectory fits no micro-batch)."""
    log_prob_chunk_tokens: int = Field(8192, ge=0, le=1_048_576)
    """With ``use_remove_padding``: the LM head projects at most this many scored tokens onto
    the vocabulary at a time; a micro-batch with more is done in chunks recomputed in backward,
    so its float32 logits never exist at once (peak O(chunk × vocabulary)). 0: all at once.
    The recomputation costs speed: on one H100 (1.5B, 8192-token micro-batches) one chunk ran
    at 27.0 k tok/s and 65 GiB peak, chunks of 1024 at 25.1 k tok/s and 55 GiB
    (docs/benchmarks.md): lower it when memory is short."""
    lora_rank: int = Field(0, ge=0, le=1024)
    """LoRA adapter rank (verl's ``lora_rank``). 0: every weight is trained. > 0: peft LoRA
    adapters on ``target_modules`` are trained, the base weights frozen; checkpoints hold the
    adapters and their optimiser state only, the engines get the adapter (or the merged
    weights: ``sync.lora_weights``), and ``export_hf`` adds the peft adapter (docs/trainer.md,
    "LoRA")."""
    lora_alpha: float = Field(16.0, gt=0.0, le=65536.0)
    """LoRA scale numerator: the adapter adds ``(B @ A) * lora_alpha / lora_rank``."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get adapters, by name as peft takes them: ``all-linear`` (every linear
    layer but the output layer), or names such as ``["q_proj", "v_proj"]``. A name the model
    lacks is refused when the trainer starts."""
    use_torch_compile: bool = False
    """``torch.compile`` each decoder layer (verl's name); pays on GPUs, not on this CPU."""
    router_replay: RouterReplayConfig = Field(default_factory=RouterReplayConfig)
    """Routing replay for mixture-of-experts models (issue 53)."""
    attn_implementation: Literal["auto", "sdpa", "segmented_sdpa", "flex_attention", "flash_attention_2", "eager"] = "auto"
    """The trainer's attention kernel. auto: with ``use_remove_padding`` on CUDA,
    ``flash_attention_2`` when the ``flash-attn`` package is installed, else ``flex_attention``
    (packed rows need a block-diagonal mask, which sdpa only takes dense: 2.2x slower on an
    H100); with ``use_remove_padding`` on the CPU ``segmented_sdpa`` (causal sdpa on each
    sequence of a packed row: no dense mask; flex has no backward there); ``sdpa`` otherwise."""


class NatsConfig(Section):
    url: str | None = None
    """NATS server URL (``nats://host:4222``). None: start or use the embedded server."""
    embedded_port: int = Field(0, ge=0, le=65535)
    """Port of the embedded server (0: a free port)."""
    embedded_host: str = "127.0.0.1"
    """Address the embedded server binds to (``asyncrl slurm`` binds it to every interface of
    the batch host, for the trainer nodes; keep that network private)."""
    store_dir: str | None = None
    """Directory of the embedded server's JetStream store (a fast local or shared disk that
    outlives the job). None: ``<run dir>/nats``."""
    stream_max_bytes: int = Field(4 * 2**30, ge=2**20)
    """Byte limit of the run's stream. With discard=new, a full stream rejects publishes. NATS
    reserves it against its store limit (by default 75 % of the disk's free space) when the
    stream is created: a reservation that does not fit stops the start naming this knob."""
    duplicate_window_s: float = Field(1800.0, ge=1.0, le=7 * 86400.0)
    """``Nats-Msg-Id`` dedup window; must exceed how long the outbox may retry a publish."""
    dead_letters_keep: int = Field(10_000, ge=0)
    """Dead letters (undecodable messages the trainer copied aside) kept in the stream: the
    newest this many; older ones are purged with each checkpoint's purge."""
    sync_always: bool = False
    """Embedded server: fsync every write (survives an OS crash, slower)."""
    user: str | None = None
    """NATS user name (with ``security.nats_password``)."""


class CheckpointConfig(Section):
    save_freq: int = Field(0, ge=0)
    """Save a sharded checkpoint every this many steps (0: only at the end)."""
    keep_last: int = Field(2, ge=1)
    """Complete checkpoints kept."""
    async_save: bool = False
    """Write checkpoints in the background (``torch.distributed.checkpoint.async_save``)."""
    export_hf: bool = True
    """Also export a Hugging Face safetensors directory with each checkpoint."""
    resume: bool = True
    """Resume from the newest complete checkpoint in the run directory."""


class TrainerConfig(Section):
    nnodes: int = Field(1, ge=1, le=4096)
    """torchrun ``--nnodes``."""
    nproc_per_node: int = Field(1, ge=1, le=1024)
    """torchrun ``--nproc-per-node``."""
    node_rank: int = Field(0, ge=0)
    """torchrun ``--node-rank``."""
    master_addr: str = "127.0.0.1"
    """Rendezvous address of the trainer's own process group."""
    master_port: int = Field(0, ge=0, le=65535)
    """Rendezvous port (0: a free port, single node only)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """``cpu`` trains with gloo in fp32; ``cuda`` with NCCL."""
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    """FSDP2 parameter dtype (``bf16``: bf16 params, fp32 reduce)."""
    total_training_steps: int | None = Field(None, ge=1)
    """Stop after this many updates. None: derived from ``rollout.total_rollout_steps``."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpointing."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port of trainer rank 0. Unset (None): 9400 when the trainer is started alone
    (``asyncrl trainer``); ``asyncrl up`` draws a free one (a port named is kept); ``asyncrl
    slurm`` draws every port of its job. 0: a free one."""

    @property
    def metrics_listen_port(self) -> int:
        """The Prometheus port rank 0 binds: ``metrics_port``, or 9400 when unset."""
        return STANDALONE_METRICS_PORT if self.metrics_port is None else self.metrics_port

    metrics_host: str = "127.0.0.1"
    """Address trainer rank 0 serves Prometheus metrics on (``0.0.0.0`` to let a scraper on
    another host in)."""
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Metric sinks besides Prometheus (verl's names everywhere): the JSONL file, TensorBoard
    event files in ``<run dir>/tensorboard/trainer``, Weights & Biases, MLflow (the last two
    need ``asyncrl[tracking]``; docs/trainer.md, "Experiment tracking")."""
    project_name: str = Field("asyncrl", min_length=1, max_length=200)
    """W&B project / MLflow experiment (verl's ``trainer.project_name``)."""
    experiment_name: str | None = Field(None, min_length=1, max_length=200)
    """W&B / MLflow run name (verl's ``trainer.experiment_name``). None: ``run.id``."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """``offline`` writes the W&B run under ``<run dir>/wandb/`` with no network (``wandb sync``
    uploads it later); ``online`` needs ``WANDB_API_KEY``."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server or store. None: a file store under ``<run dir>/mlruns``."""
    weight_sync_backend: Literal["gloo", "nccl"] | None = None
    """Backend of the trainer↔engines weight group. None: nccl when ``engines.backend`` is
    ``sglang`` and ``device`` is ``cuda``; gloo otherwise (local engines join gloo groups only,
    even on a GPU)."""
    step_time_floor_s: float = Field(0.0, ge=0.0, le=3600.0)
    """Benchmarks only: pad every training step to at least this long (emulates a bigger model)."""
    weight_sync_port: int = Field(0, ge=0, le=65535)
    """Port of the weight-group rendezvous on trainer rank 0 (0: a free port)."""
    ack_wait_s: float = Field(60.0, ge=1.0, le=3600.0)
    """``ack_wait`` of the trainer's durable consumer: a message neither acked nor kept alive
    (rank 0 sends "in progress" for every held message every quarter of this) for this long is
    redelivered. A trainer that stops answering (SIGSTOP, a long GC pause) gets its held
    messages redelivered; the ID check keeps each trained once (RELIABILITY.md F4)."""
    stop_timeout_s: float = Field(20.0, gt=0.0, le=3600.0)
    """After SIGTERM/SIGINT: the time within which the trainer writes its checkpoint and exits,
    whatever else is stopping with it (``scancel`` and Kubernetes signal every process at
    once and kill them 30 s later by default). It finishes the step it is in, waits for a
    weight sync in flight only within this budget (the checkpoint then records that sync's
    version as pending, which a resume settles), and leaves the stream's purge to the next run."""


class PerRequestConfig(Section):
    """``sync.pause_policy = "per_request"``: one decision per generate call in flight when a sync
    pauses (``asyncrl.sync_control.request_policy``; docs/sync_agent.md, "Per-request pauses")."""

    survivor_mode: Literal["in_place", "retract"] = "in_place"
    """How the engines pause for the calls the rule keeps (an engine pauses as a whole): their
    requests stay at the engine with their KV (``in_place``: no flush, tokens after the sync
    decoded over KV of the old weights) or queued with their KV freed and re-prefilled
    (``retract``: flushed, SGLang 0.5.21+). The same checks as the global policy of that name."""
    keep_min_progress: float = Field(0.5, ge=0.0, le=1.0)
    """A call with at least this share of its expected response decoded is kept (finishing a few
    tokens over the old weights costs less than re-prefilling it); below it, it is aborted and
    resumed on the new weights. 0 keeps every call (the survivor mode alone); 1 resumes every
    call that is not complete."""
    resume_max_context: int = Field(2048, ge=0)
    """A call whose context (prompt and response so far) is longer than this many tokens is kept
    whatever its progress: re-prefilling it would cost more than it saves."""
    project_versions: bool = True
    """Judge a call's staleness at the version its trajectory is expected to be trained at: the
    sync's version plus the versions the trainer adds while the call decodes its expected rest
    (from the lengths of finished turns, the decode rate and the pace of versions the rollout
    service measures). False: at the sync's version alone, so a cancel is certain to spare only
    tokens the trainer would drop, but long-tail calls that will become too stale before they
    finish decode to the end and are dropped by the trainer."""
    cancel_stale: bool = True
    """Cancel a call whose trajectory the trainer would certainly drop for staleness (its oldest
    token more than ``derived.stale_cancel_lag`` versions behind), at a sync and before each
    generate call between syncs, instead of decoding it to the end. Only under the trainer's
    ``stale_policy = "drop"`` with ``staleness_age = "oldest"`` (otherwise no call is certain
    to be dropped and none is cancelled)."""


class SyncConfig(Section):
    host: str = "127.0.0.1"
    """Address the sync agent binds to."""
    port: int | None = Field(None, ge=0, le=65535)
    """Port of the sync agent. Unset (None): 8100 when the agent is started alone
    (``asyncrl sync-agent``); ``asyncrl up`` draws a free one (a port named is kept); ``asyncrl
    slurm`` draws every port of its job. 0: a free one."""

    @property
    def listen_port(self) -> int:
        """The port the agent binds: ``port``, or 8100 when unset (an agent started alone)."""
        return STANDALONE_SYNC_PORT if self.port is None else self.port

    history_max_bytes: int = Field(16 * 2**20, ge=4096)
    """The sync history file (``<run dir>/sync/history.jsonl``) rotates past this size; it
    keeps one previous file, so it takes at most twice this on disk."""
    url: str | None = None
    """Where other components reach the sync agent. None: http://host:port."""
    bucket_bytes: int = Field(256 * 2**20, ge=2**16)
    """Most bytes of one weight bucket (tensors packed as bytes, SGLang's ``flattened_bucket``;
    dtypes may mix; a larger tensor gets a bucket of its own)."""
    staging: Literal["auto", "buckets", "two_buckets", "state_dict"] = "auto"
    """How the trainer snapshots a version for the sync. ``buckets``: at the sync point every
    rank gathers the parameters bucket by bucket and rank 0 packs them, cast to
    ``model.dtype``, into reused byte buffers on the weight group's device (the GPU for NCCL):
    milliseconds, and the publish only broadcasts; costs the model's bytes in ``model.dtype``
    of memory there for the trainer's lifetime. ``two_buckets``: the same walk during the
    publish, rank 0 packing each bucket into one of two reused buffers while the other is
    broadcast: memory bounded by ``2 × bucket_bytes``, but training waits for the publish
    (engines' pause and broadcast) until the last bucket is packed. ``state_dict``: the full
    state dict to host memory, packed bucket by bucket during the publish (the CPU path).
    ``auto``: ``state_dict`` unless the weight group is NCCL; with NCCL ``buckets`` while the
    model's bytes are at most 10 % of the GPU's memory, else ``two_buckets``.
    ``trainer_daemon.sync.staging``, ``trainer_daemon.sync.streaming``."""
    check_weights: bool = True
    """After every update, while the engines are still paused, ask each (two or more) for the
    checksum of the weights it serves (SGLang's ``/weights_checker``, 0.5.15+) and treat one
    that disagrees with the others of its layout as holding mixed weights: the sync fails and
    the sync agent quarantines it until it is rewritten. Costs one hash of the weights on
    every engine inside the pause window. ``asyncrl.sync_control.weights_check``."""
    pause_timeout_s: float = Field(120.0, gt=0.0)
    """Limit of the pause phase (drain mode waits for in-flight generations)."""
    pause_policy: Literal["abort", "retract", "in_place", "per_request"] = "abort"
    """What a sync does with generations in flight when partial rollout is active: ``abort``
    them (the rollout resends prompt + kept tokens after the sync: re-prefilled), ``retract``
    (the engines keep them queued with their KV freed and re-prefill them: SGLang 0.5.21+ to
    flush the prefix cache), ``in_place`` (engines keep requests and KV; no flush; tokens after
    the sync are decoded over KV of the old weights), ``per_request`` (each call kept, aborted
    and resumed, or cancelled by its own facts: ``sync.per_request``; needs the sync agent).
    ``asyncrl.sync_control.pause_policy``; docs/sync_agent.md, "Pause policies"."""
    per_request: PerRequestConfig = Field(default_factory=PerRequestConfig)
    """The rule of ``pause_policy = "per_request"`` (ignored by the other policies)."""
    broadcast_timeout_s: float = Field(300.0, gt=0.0)
    """Limit of the weight broadcast (all buckets)."""
    resume_timeout_s: float = Field(30.0, gt=0.0)
    """Limit of the resume phase."""
    group_init_timeout_s: float = Field(120.0, gt=0.0)
    """Limit of forming the weight-update group with the engines."""
    rollout_url: str | None = None
    """Admin URL of the rollout service the agent pauses and resumes. None: http://rollout.host:port,
    the port ``rollout.port`` or, unset, 8000 (``RolloutConfig.listen_port``)."""
    reload_path: str | None = None
    """Hugging Face directory engines reload from after a failed update (None: the trainer's newest
    export named in the sync request, if any; otherwise the engine waits for the next full push)."""
    reconcile_interval_s: float = Field(2.0, gt=0.0, le=600.0)
    """How often the agent checks engines' versions and health, reloads and releases them."""
    engine_timeout_s: float = Field(30.0, gt=0.0)
    """Limit of one control call to an engine (pause, flush, continue, model_info, an adapter load)."""
    lora_weights: Literal["adapter", "merged"] = "adapter"
    """With ``actor.lora_rank > 0``, what a sync sends. ``adapter``: the adapter alone (a few
    MB), loaded on every engine under a name per version (``<run id>-v<version>``) that the
    rollout service asks for with ``lora_path``; engines need ``--enable-lora``,
    ``--max-lora-rank`` >= the rank and ``--lora-target-modules`` covering the targets (checked
    at start), and the sync agent (``sync.url``). ``merged``: the adapter merged into the full
    weights, broadcast as a full-weight run does (engines without LoRA support).
    docs/sync_agent.md, "Adapter syncs"."""
    adapter_transport: Literal["auto", "tensors", "path"] = "auto"
    """How an adapter reaches an engine. ``tensors``: in the request body
    (``/load_lora_adapter_from_tensors``; SGLang 0.5.21+ and local_engine). ``path``: a peft
    directory the trainer writes under ``adapter_dir`` (``/load_lora_adapter``; the engines must
    read it: shared storage). ``auto``: per engine, ``tensors`` where its release takes them,
    else ``path``; with ``adapter_dir`` set, also ``path`` for an adapter whose bytes × the
    engine's ``tp_size`` exceed 256 MiB (the tensors are repeated per TP rank in one body)."""
    adapter_dir: str | None = None
    """Where the trainer writes each version's adapter directory for ``path`` transport (keeping
    the last three). None: ``<run dir>/adapters`` (readable by engines on the trainer's host)."""


class SecurityConfig(Section):
    admin_token: SecretStr | None = None
    """Bearer token of admin routes (rollout /admin/*). Required unless ``insecure_dev``."""
    api_token: SecretStr | None = None
    """Bearer token of the data plane (OpenAI routes, sessions). None: open data plane."""
    sync_token: SecretStr | None = None
    """Bearer token of the sync agent's routes."""
    status_token: SecretStr | None = None
    """Read-only bearer token of the sync agent's GET routes (``/status``, ``/v1/syncs``): for
    monitoring (compose's JSON exporter), which must not hold the sync token (a sync can point
    every engine at any weight-group address)."""
    environment_tokens: dict[str, SecretStr] = Field(default_factory=dict)
    """Bearer token per external environment (``rollout.external_tools[].environment``): an
    environment with one lists its parked calls (and gets their session tokens) with it only,
    never with the data-plane token; one without falls back to ``api_token`` (a warning at start)."""
    nats_password: SecretStr | None = None
    """Password of ``nats.user``."""
    insecure_dev: bool = False
    """Allow empty tokens (local development only)."""


class RunSection(Section):
    id: str = Field("demo", pattern=RUN_ID_PATTERN)
    """Run id: lower-case letters, digits, ``-`` and ``_`` (NATS names derive from it)."""
    dir: str = "runs/{id}"
    """Run directory for logs, NATS store, checkpoints, metrics (``{id}`` is substituted)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of every component (the local engines ``asyncrl up`` starts included)."""
    log_json: bool = False
    """Every component logs JSON lines to stderr, one object per record with ``time``,
    ``level``, ``logger``, ``message`` and, when there is one, ``exception`` (see
    ``asyncrl.logs``), instead of text lines."""
    progress_window_s: float = Field(60.0, gt=0, le=3600)
    """The window over which the rollout service's ``/admin/status`` and the sync agent's
    ``/status`` count progress (tokens decoded, trajectories published, syncs succeeded) and
    call the run ``stalled`` with a reason when nothing moved in it (``health`` in each)."""
