"""Config sections for the model, the data, the rollout and verl's async-training knobs.

Every field has a docstring, a default where one makes sense, and bounds. Names follow
verl's fully_async_policy where verl has the knob (``staleness_threshold``,
``trigger_parameter_sync_step``, ``require_batches``, ``partial_rollout``,
``use_rollout_log_probs``, ``compute_prox_log_prob``, ``ppo_mini_batch_size``).

Vocabulary used throughout asyncrl, as in verl's docs: a *sample* is one prompt and the
``rollout.n`` trajectories generated for it (a *group*); a *trajectory* is one episode.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

STANDALONE_ROLLOUT_PORT = 8000
"""``rollout.port`` unset: the rollout service started alone binds this (``asyncrl up`` draws one)."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are validated on
    assignment too, and field docstrings become the field descriptions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelConfig(Section):
    path: str = "builtin:tiny"
    """Model spec: ``builtin:tiny``, ``builtin:smollm2-135m`` or a local Hugging Face model
    directory. The engines, the trainer and the rollout tokenizer all load this."""
    tokenizer_path: str | None = None
    """Tokenizer spec when it differs from ``path`` (same forms)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype on the engines (CPU: float32 is exact, bfloat16 ~2x faster)."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Initialisation seed of builtin models; the same seed gives identical weights everywhere."""
    max_model_len: int = Field(4096, ge=16, le=1_048_576)
    """Longest sequence (prompt + response, all turns) any component accepts, in tokens."""


class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list)
    """JSONL or Parquet files in verl's layout (``prompt``, ``data_source``,
    ``reward_model.ground_truth``, ``extra_info``). Empty: ``source``, else the built-in demo task
    (its files written by ``asyncrl rollout``; the rollout service alone refuses to start)."""
    source: str | None = Field(None, pattern=r"^(sessions|reasoning_gym:[A-Za-z0-9_]+|verifiers:[A-Za-z0-9_][A-Za-z0-9_.\-/]*)$")
    """Data instead of files. ``sessions``: the service runs no agents of its own; every
    trajectory comes from sessions that external agents drive (any OpenAI, Responses or
    Anthropic client; docs/openai_api.md) with the rewards they set, and the run ends at
    ``trainer.total_training_steps`` or when stopped (the rollout never says its data is played
    out). ``reasoning_gym:<dataset>``: a generated task (any reasoning-gym
    dataset; needs ``asyncrl[reasoning-gym]``), scored by the task's own verifier
    (docs/data_and_rewards.md, "reasoning-gym tasks"). ``verifiers:<environment id>``: a
    verifiers environment plays its own dataset, turns and rubric through sessions
    (``asyncrl[verifiers]``; the id as ``verifiers.load_environment`` takes it: an installed
    environment or an importable module; docs/verifiers.md)."""
    source_options: dict[str, Any] = Field(default_factory=dict)
    """The source's own settings: the generator's for reasoning-gym (e.g. ``{max_terms = 3,
    max_digits = 2}`` for ``basic_arithmetic``: its difficulty knobs, where it has them), the
    keyword arguments of ``load_environment`` for a verifiers environment."""
    source_size: int = Field(2000, ge=1, le=10_000_000)
    """Training problems generated for a reasoning-gym ``source`` (seed ``data.seed``)."""
    source_val_size: int = Field(64, ge=0, le=1_000_000)
    """Validation problems generated for a reasoning-gym ``source`` (seed ``data.seed + 1``; 0: none)."""
    source_answer: Literal["tag", "tag_or_last_number"] = "tag"
    """How a reasoning-gym response's answer is read: its last ``<answer>`` tag (reasoning-gym's
    rule), or, with no tag, its last number (numeric tasks, models too small to write tags)."""
    val_files: list[str] = Field(default_factory=list)
    """Validation files in the same layout. Empty: no validation unless the demo task."""
    shuffle: bool = True
    """Shuffle prompts each epoch (deterministically from ``seed``)."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed of the prompt order."""
    demo_level: int = Field(3, ge=0, le=3)
    """Difficulty of the built-in demo task (used when ``train_files`` is empty): 0 = two
    operands 50–99 with + (fixed token lengths; the `asyncrl up` demo); 1 = two operands up
    to 20 with + and -; 2 = two operands up to 99 with + - *; 3 = 2–3 operands up to 999."""
    max_prompt_length: int = Field(1024, ge=1, le=1_048_576)
    """Prompts longer than this many tokens (after the chat template) are skipped and reported."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature; 0 means greedy. Rollout logprobs are of the
    temperature-scaled distribution, and the trainer scales its logits the same way."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = Field(-1, ge=-1)
    """Keep the k most likely tokens; -1 keeps all."""
    max_new_tokens: int = Field(256, ge=1, le=1_048_576)
    """Upper bound of tokens per assistant turn (also bounded by ``rollout.response_length``)."""


class MultiTurnConfig(Section):
    max_assistant_turns: int = Field(4, ge=1, le=1000)
    """Most assistant (model) turns per trajectory."""
    max_user_turns: int = Field(4, ge=0, le=1000)
    """Most tool/environment turns per trajectory."""
    max_parallel_calls: int = Field(1, ge=1, le=64)
    """Most tool calls executed from one assistant turn; extra calls get an error result."""
    tool_timeout_s: float = Field(10.0, gt=0.0, le=3600.0)
    """Wall-clock limit of one tool call."""
    max_tool_response_length: int = Field(256, ge=1, le=1_048_576)
    """Tool results are truncated to this many tokens before entering the context."""
    tool_parser: Literal["hermes"] = "hermes"
    """Parser of tool calls in model output (``hermes``: ``<tool_call>{json}</tool_call>``,
    used by Qwen2.5/Qwen3 and the builtin models)."""


class ExternalToolConfig(Section):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    """Function name the model calls."""
    description: str = Field("", max_length=2000)
    """What the tool does (shown to the model)."""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON schema of the arguments (OpenAI function ``parameters``)."""
    environment: str = Field("default", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """Environment that answers it: calls are announced on ``asyncrl.<run>.env.<environment>``."""
    deadline_s: float = Field(60.0, gt=0.0, le=86400.0)
    """Time the environment has to post the result."""
    on_timeout: Literal["error", "abort"] = "error"
    """At the deadline: give the model an error result, or end the episode (finish_reason ``expired``)."""


class RolloutConfig(Section):
    n: int = Field(4, ge=1, le=1024)
    """Trajectories per prompt (the GRPO group size)."""
    max_concurrent: int | None = Field(None, ge=1, le=1_000_000)
    """Trajectories in flight at once. None: 16 per engine (verl's ``max_concurrent_samples``)."""
    response_length: int = Field(512, ge=1, le=1_048_576)
    """Total response tokens per trajectory across all turns (model and tool tokens)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling of training rollouts."""
    val_sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=0.0))
    """Sampling of validation rollouts (greedy by default)."""
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    """Limits of the multi-turn tool agent."""
    total_rollout_steps: int | None = Field(None, ge=1)
    """Total samples (prompts) to roll out, as verl's ``rollout.total_rollout_steps``. None: epochs."""
    total_epochs: int = Field(1, ge=1, le=100_000)
    """Passes over the training data when ``total_rollout_steps`` is None."""
    test_freq: int = Field(-1, ge=-1)
    """Validate every this many weight versions; -1 never."""
    val_before_train: bool = False
    """verl's ``trainer.val_before_train``: validate once at version 0, when a run starts from
    scratch, so that its validation curve has a starting point."""
    publish_unit: Literal["trajectory", "group"] = "trajectory"
    """Publish each trajectory when it finishes, or a group when all of its ``n`` finish."""
    host: str = "127.0.0.1"
    """Address the rollout service binds to."""
    port: int | None = Field(None, ge=0, le=65535)
    """Port of the rollout service. Unset (None): 8000 when the service is started alone
    (``asyncrl rollout``); ``asyncrl up`` draws a free one, so two runs on one machine never
    meet, and keeps a port named; ``asyncrl slurm`` draws every port of its job. 0: a free one."""

    @property
    def listen_port(self) -> int:
        """The port the service binds: ``port``, or 8000 when unset (a service started alone)."""
        return STANDALONE_ROLLOUT_PORT if self.port is None else self.port

    quota_starvation_s: float = Field(30.0, gt=0.0, le=3600.0)
    """A trainer that holds less than a step while nothing is in flight or undelivered and the
    staleness quota is used up (it dropped samples as too stale: no version can come before new
    samples) for this long gets the samples it is short of credited to the quota. Far longer
    than a sync takes to pause the rollout after the trainer's last step of a version, when the
    same state lasts a moment in every run (issue 65)."""
    outbox_max_items: int = Field(10_000, ge=1)
    """Finished trajectories held on disk while NATS is unreachable; past it admission stops."""
    outbox_keep_acked_s: float = Field(150.0, ge=0.0)
    """Acknowledged trajectories stay in the outbox this long, to be published again if NATS
    loses them in a host crash before its fsync (its sync interval is 2 min by default; 0 with
    ``nats.sync_always``). They do not count against ``outbox_max_items``."""
    published_record_max_bytes: int = Field(64 * 2**20, ge=4096)
    """The published record (``<run dir>/rollout/published.jsonl``: id and stream sequence of
    every PubAck) rotates past this size, one previous file kept."""
    tools: list[str] = Field(default_factory=lambda: ["calculator"])
    """Builtin tools the agents may call (``calculator``, ``python``); their schemas go into the prompt."""
    external_tools: list[ExternalToolConfig] = Field(default_factory=list)
    """Tools answered by external environments over HTTP (see docs/openai_api.md)."""
    tool_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per-tool keyword options, e.g. ``{"python": {"memory_mb": 256}}``."""
    python_sandbox_url: str | None = Field(None, pattern=r"^unix:///.+")
    """Where the ``python`` tool runs programs: ``unix:///path`` of a python sandbox server
    (``asyncrl python-sandbox``; compose's ``python-sandbox`` service). None: in this service's
    own sandbox, which needs the service to run as root (docs/security.md). Ignored unless
    ``tools`` lists ``python``."""
    format_reward_weight: float = Field(0.0, ge=0.0, le=10.0)
    """Weight of the format reward added to the task reward (0: task reward only)."""
    pause_timeout_s: float = Field(120.0, gt=0.0)
    """Limit of ``/admin/pause`` (drain mode waits for in-flight trajectories)."""


class AsyncTrainingConfig(Section):
    staleness_threshold: float = Field(0.5, ge=0.0, le=100.0)
    """verl: the fraction of stale samples allowed. Between two syncs the rollout starts at most
    ``(1 + staleness_threshold) * trigger_parameter_sync_step * require_batches *
    ppo_mini_batch_size`` samples minus the stale ones already produced. 0 = synchronous."""
    trigger_parameter_sync_step: int = Field(1, ge=1, le=100_000)
    """verl: local trainer updates between two weight syncs."""
    require_batches: int = Field(1, ge=1, le=100_000)
    """verl: ``ppo_mini_batch_size`` batches the trainer takes at once for one update."""
    partial_rollout: bool = True
    """verl: at a sync, abort in-flight generations and continue them afterwards (modes d);
    False drains them first (mode c). Only takes effect when ``staleness_threshold > 0``."""
    use_rollout_log_probs: bool = True
    """verl: use the engine's logprobs as the PPO old logprobs (the fully async default)."""
    compute_prox_log_prob: bool = False
    """verl: compute proximal logprobs with a trainer forward pass before the update
    (decoupled PPO); the rollout logprobs then only enter the importance-sampling correction."""
    staleness_age: Literal["oldest", "token_mean"] = "oldest"
    """How a trajectory's age (trainer version minus its tokens' weight versions) is measured
    against the bound ``ceil(staleness_threshold)`` (+1 with partial rollout): by its oldest
    model token, or by the mean over its model tokens (a partial rollout mostly generated by
    fresh weights counts as young). docs/algorithms.md section 8."""
    stale_policy: Literal["drop", "downweight"] = "drop"
    """What happens to a trajectory older than the bound: dropped (never trained), or trained
    with its advantage multiplied by ``stale_decay ** (age - bound)``."""
    stale_decay: float = Field(0.5, gt=0.0, le=1.0)
    """Weight factor per version beyond the bound when ``stale_policy = "downweight"``."""

    @property
    def partial_rollout_active(self) -> bool:
        """Whether syncs abort and continue in-flight generations (``partial_rollout`` with
        ``staleness_threshold > 0``) rather than draining them: the one place this rule lives."""
        return self.partial_rollout and self.staleness_threshold > 0

    @property
    def recomputes_log_probs(self) -> bool:
        """Whether the trainer computes the PPO anchor log-probs itself (a no-grad forward pass
        before the update: ``compute_prox_log_prob``, or ``use_rollout_log_probs`` off) rather
        than taking the rollout's: the one place this rule lives."""
        return self.compute_prox_log_prob or not self.use_rollout_log_probs


class ApiConfig(Section):
    max_body_bytes: int = Field(4 * 2**20, ge=1024, le=2**30)
    """Largest request body (413 above it, before it is parsed)."""
    max_messages: int = Field(256, ge=1, le=100_000)
    """Most chat messages per request (400 above it, before tokenisation)."""
    max_tokens: int = Field(8192, ge=1, le=1_048_576)
    """Largest ``max_tokens`` / ``max_completion_tokens`` a request may ask for."""
    max_sessions: int = Field(1024, ge=1, le=1_000_000)
    """Open sessions at once (429 above it)."""
    max_session_metadata_bytes: int = Field(65_536, ge=0, le=16 * 2**20)
    """Largest ``metadata`` of a session (its JSON; 400 above it): with ``max_sessions`` it
    bounds what sessions hold in memory and the KV bucket."""
    max_session_responses: int = Field(256, ge=1, le=100_000)
    """Stored Responses API turns per session (``store`` not false): a turn that would store one
    more is refused (400, naming this; ``store: false`` or a new session go on)."""
    max_session_record_bytes: int = Field(4 * 2**20, ge=65_536, le=64 * 2**20)
    """Largest a session's saved record may grow (its msgpack): a turn whose record plus its
    request body would pass it is refused (400) before it runs, so every accepted turn is
    persisted (the sessions KV bucket stores a record as one NATS message: keep this under the
    server's ``max_payload``, 8 MiB in asyncrl's configs)."""
    max_stateless_requests: int = Field(256, ge=1, le=1_000_000)
    """Stateless completions in progress at once (429 with ``Retry-After`` above it)."""
    max_long_polls: int = Field(64, ge=1, le=100_000)
    """Tool-call long-polls (``wait`` > 0) waiting at once (429 above it)."""
    session_ttl_s: float = Field(1800.0, gt=0.0)
    """A session without activity for this long expires (reported, not published)."""
    closed_session_retention_s: float = Field(3600.0, gt=0.0)
    """A finished or expired session is kept this long (``GET``, a repeated ``finish``), then
    forgotten (memory and the sessions KV bucket): 404 afterwards."""
    tool_call_retention_s: float = Field(600.0, gt=0.0)
    """An external tool call's record (its result, or that its deadline passed) is kept this
    long after the later of its deadline and its answer, in memory and the calls KV bucket, so
    an environment's retry gets the same answer (duplicate 200 / 409) across agent ends and
    service restarts; then forgotten (404)."""
    public_url: str | None = None
    """Base URL clients use to reach this service (for session ``base_url``). None: from the request."""
    model_name: str | None = None
    """Model id shown by ``/v1/models``. None: the last component of ``model.path`` (the path
    itself is never shown; requests naming it are still served)."""
    model_aliases: list[str] = Field(default_factory=list)
    """More ids a request's ``model`` may name (listed by ``/v1/models`` too)."""
    accept_any_model: bool = False
    """Serve a request whatever its ``model`` says (the permissive behaviour). Off: an unknown
    ``model`` gets OpenAI's 404 ``model_not_found``."""
    poll_max_wait_s: float = Field(30.0, gt=0.0, le=600.0)
    """Longest long-poll ``wait`` on tool-call routes."""
