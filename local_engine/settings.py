"""Settings of one local_engine process, and its command line derived from them.

``EngineSettings`` is the run config's ``engines.local`` section
(:class:`asyncrl.config.sections_engines.LocalEngineSection`, the tunable knobs) plus what
identifies one process: model, address, dtype, seed, keys, logging. Its command line is not
written by hand: every field is a flag (:mod:`local_engine.flags`), ``to_argv`` writes the
settings as flags and ``from_argv`` reads them back into the same model, so that

    EngineSettings.from_argv(s.to_argv(), environ=s.secret_env()) == s

Keys never go on the command line (``ps`` shows it): ``to_argv`` leaves them out and
``secret_env`` gives them as ``$LOCAL_ENGINE_API_KEY`` / ``$LOCAL_ENGINE_ADMIN_API_KEY``, which
``from_argv`` reads when no flag gives them, or from the file named by ``$LOCAL_ENGINE_API_KEY_FILE`` /
``$LOCAL_ENGINE_ADMIN_API_KEY_FILE`` (one trailing newline removed: a Docker secret, compose's
engine-cpu) so that the key is in no environment at all. SGLang's ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``
and ``SGLANG_HEALTH_CHECK_TIMEOUT`` are honoured the same way. A flag beats its variable.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from asyncrl.config.sections_engines import LocalEngineSection
from asyncrl.lora_targets import ALL, LINEAR_LEAVES
from local_engine.flags import add_flags, describe_errors, parsed, to_argv

if TYPE_CHECKING:
    from asyncrl.config import RunConfig
    from local_engine.compat import SglangCompat

SERVABLE_TARGETS = {*LINEAR_LEAVES, "qkv_proj", "gate_up_proj", ALL}
"""``--lora-target-modules`` values: the linear layers of Llama/Qwen2 models, SGLang's grouped
names for them, ``all``."""
SECRET_ENV = {"api_key": "LOCAL_ENGINE_API_KEY", "admin_api_key": "LOCAL_ENGINE_ADMIN_API_KEY"}
"""Key fields and the variables that carry them instead of flags."""
SGLANG_ENV = {"health_generation": "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION",
              "health_check_timeout_s": "SGLANG_HEALTH_CHECK_TIMEOUT"}
"""Fields SGLang takes from environment variables; local_engine honours the same ones."""


def check_lora_settings(enable: bool | None, paths: list[str] | None, max_rank: int | None,
                        targets: list[str] | None, max_loaded: int | None, per_batch: int = 8) -> bool:
    """Whether LoRA is on, after SGLang's start-time checks (``arg_groups/lora_hook.py``);
    raises ValueError with its messages."""
    on = bool(enable) or (enable is None and bool(paths))
    if not on:
        return False
    if not paths and not (max_rank and targets):
        raise ValueError("When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
                         "--lora-target-modules for LoRA initialization.")
    unknown = sorted(set(targets or []) - SERVABLE_TARGETS)
    if unknown:
        raise ValueError(f"--lora-target-modules: {unknown} are not modules local_engine can adapt "
                         f"(choose from {sorted(SERVABLE_TARGETS)})")
    if targets and "all" in targets and len(targets) != 1:
        raise ValueError("If 'all' is specified in --lora-target-modules, it should be the only module specified.")
    if max_loaded is not None and max_loaded < per_batch:
        raise ValueError(f"max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                         f"max_loaded_loras={max_loaded}, max_loras_per_batch={per_batch}")
    if max_loaded is not None and len(paths or []) > max_loaded:
        raise ValueError(f"The number of LoRA paths should not exceed max_loaded_loras. "
                         f"max_loaded_loras={max_loaded}, lora_paths={len(paths or [])}")
    return True


class SettingsError(ValueError):
    """Invalid engine settings; the message has one line per problem naming field and flag."""


class EngineSettings(LocalEngineSection):
    """Everything :func:`local_engine.app.create_app` needs to build an engine."""

    model_config = ConfigDict(frozen=True)

    model: str = "builtin:tiny"
    """Model spec for :func:`asyncrl.models.load_model`: ``builtin:tiny``,
    ``builtin:smollm2-135m`` or a local Hugging Face directory."""
    host: str = "127.0.0.1"
    """Interface to listen on. Loopback by default: the admin routes change weights."""
    port: int = Field(30000, ge=0, le=65535)
    """TCP port (SGLang's default is 30000)."""
    port_slots: int = Field(1, ge=1, le=256)
    """Slots of replicas sharing a host's network (compose ``--scale`` under host networking,
    compose.cluster.yaml): each replica locks the first free slot ``k`` in ``slot_dir`` and
    listens on exactly ``port + k``, as docker/sglang/engine.sh's GPU slots do; a slot's port
    held by anything but a replica, or every slot taken, exits 2 naming it
    (:mod:`local_engine.port_slot`). More than 1 needs ``slot_dir``."""
    slot_dir: str | None = None
    """The directory the replicas of one host share for their slot locks (compose: a volume).
    None: one slot, ``port`` exactly."""
    addr_file: str | None = None
    """Where to write ``host:port`` once the port is claimed (a container healthcheck reads it)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype. float32 gives logprobs that match a float32 trainer to ~1e-6;
    bfloat16 is ~2x faster on CPUs with bf16 support."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Initialisation seed of builtin models, and the seed of the engine's sampling RNG
    (and of timing mode's lengths)."""
    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt + max_new_tokens accepted. None: the model's max_position_embeddings."""
    api_key: str | None = None
    """Bearer token for every route except /health*, /metrics (SGLang ``--api-key``)."""
    admin_api_key: str | None = None
    """Bearer token of the admin routes (weights, pause, continue, abort, flush); when set,
    the plain api_key no longer opens them (SGLang ``--admin-api-key``)."""
    weight_version: str = "default"
    """Weight version reported before the first update."""
    served_model_name: str | None = None
    """Name in /v1/models and /server_info. None: the model spec."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the engine and uvicorn."""
    log_json: bool = False
    """Log JSON lines (``asyncrl.logs``) instead of text."""
    enable_lora: bool | None = None
    """Serve LoRA adapters (SGLang ``--enable-lora``; on by default when ``lora_paths`` is
    given): ``/load_lora_adapter``, ``/load_lora_adapter_from_tensors``,
    ``/unload_lora_adapter`` and ``/generate``'s ``lora_path`` (:mod:`local_engine.lora`)."""
    max_lora_rank: int | None = Field(None, ge=1)
    """Highest adapter rank accepted (SGLang ``--max-lora-rank``). None: the highest of
    ``lora_paths``."""
    lora_target_modules: list[str] | None = None
    """Modules adapters may target (SGLang ``--lora-target-modules``, e.g. ``q_proj v_proj``
    or ``all``). None: the union of ``lora_paths``' targets."""
    lora_paths: list[str] | None = None
    """Adapters loaded at start, each ``NAME=PATH`` or ``PATH`` (SGLang ``--lora-paths``)."""
    max_loaded_loras: int | None = Field(None, ge=1)
    """At most this many adapters loaded; a load over it unloads the least recently used
    (SGLang ``--max-loaded-loras``). None: no limit. SGLang refuses to start with it below
    ``max_loras_per_batch``; so does local_engine."""
    max_loras_per_batch: int = Field(8, ge=1)
    """SGLang ``--max-loras-per-batch`` (default 8): reported in /server_info and checked against
    ``max_loaded_loras`` at start as SGLang checks it; local_engine's batches are not limited by it."""

    enable_return_routed_experts: bool = False
    """Answer ``return_routed_experts`` (SGLang ``--enable-return-routed-experts``): the experts
    each token was routed to, in ``meta_info["routed_experts"]`` (:mod:`local_engine.routes`).
    A model without a top-k router refuses to start with it, as does timing mode (it computes
    nothing); off, a request asking for routes is answered without them, as SGLang does."""

    sglang_fatal_errors: bool = False
    """Exit, as SGLang's server does, on the inputs that kill SGLang's scheduler (an uncaught
    exception there takes the whole server down): an input id outside the vocabulary, an
    adapter payload that does not decode, whose ``expected_checksums`` do not match, or whose
    ``serialized_named_tensors`` has fewer entries than ``tp_size``. Off: a 400 naming the
    problem (what tests of the input itself want). The connection is dropped without an answer,
    and the process exits with status 70."""
    sampling_mask_max_tokens: int = Field(4096, ge=1)
    """Largest sampling support ``return_sampling_mask`` reports; a request whose support is
    larger ends with an abort, 400 (SGLang 0.5.20+ ``--sampling-mask-max-tokens``; no bound
    when emulating 0.5.16-0.5.19)."""

    @model_validator(mode="after")
    def _port_range(self) -> EngineSettings:
        if self.port + self.port_slots - 1 > 65535:
            raise ValueError(f"port_slots: ports {self.port}..{self.port + self.port_slots - 1} go past 65535")
        if self.port_slots > 1 and not self.slot_dir:
            raise ValueError(f"port_slots={self.port_slots} needs slot_dir: a directory the replicas share to lock "
                             "their slots (issue 67 L6: without, a replica would take any free port of the range)")
        return self

    @model_validator(mode="after")
    def _lora(self) -> EngineSettings:
        check_lora_settings(self.enable_lora, self.lora_paths, self.max_lora_rank, self.lora_target_modules,
                            self.max_loaded_loras, self.max_loras_per_batch)
        return self

    @property
    def lora_on(self) -> bool:
        return bool(self.enable_lora) or (self.enable_lora is None and bool(self.lora_paths))

    @field_validator("sglang_compat")
    @classmethod
    def _known_release(cls, v: str | None) -> str | None:
        # imported here: compat imports torch (via asyncrl.weight_sync), which --help must not wait for
        from local_engine.compat import SglangCompat

        return None if v is None else SglangCompat.of(v).version

    @property
    def compat(self) -> SglangCompat:
        from local_engine.compat import DEFAULT, SglangCompat

        return SglangCompat.of(self.sglang_compat or DEFAULT)

    # -- the command line ----------------------------------------------------------------
    def to_argv(self) -> list[str]:
        """These settings as flags (those that differ from the defaults; keys left out)."""
        return to_argv(self, skip=tuple(SECRET_ENV))

    def secret_env(self) -> dict[str, str]:
        """The environment variables that carry the keys to a child engine."""
        return {var: value for name, var in SECRET_ENV.items() if (value := getattr(self, name))}

    @classmethod
    def from_argv(cls, argv: Sequence[str], environ: Mapping[str, str] | None = None) -> EngineSettings:
        """Parse flags (``--help`` exits; unknown flags exit 2, as argparse does) and the
        variables of the module docstring; raises :class:`SettingsError` on a bad value."""
        environ = os.environ if environ is None else environ
        values = parsed(build_parser().parse_args(list(argv)))
        for name, var in {**SECRET_ENV, **SGLANG_ENV}.items():
            if name not in values and environ.get(var):
                values[name] = environ[var]
        for name, var in SECRET_ENV.items():
            if name not in values and (path := environ.get(var + "_FILE")):
                try:
                    values[name] = Path(path).read_text().removesuffix("\n")
                except OSError as exc:
                    raise SettingsError(f"{name}: cannot read ${var}_FILE ({path}): {exc.strerror or exc}") from None
        if isinstance(values.get("health_generation"), str):  # SGLang: anything but 0/false/no is on
            values["health_generation"] = values["health_generation"].lower() not in ("0", "false", "no")
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise SettingsError(describe_errors(exc, cls)) from exc

    @classmethod
    def for_run(cls, cfg: RunConfig, port: int) -> EngineSettings:
        """The settings of a local engine ``asyncrl up`` starts for ``cfg`` on 127.0.0.1:``port``:
        ``engines.local``, the ``model`` section's path, dtype, seed and ``max_model_len``, and
        ``run``'s log settings; with adapter syncs (``cfg.syncs_adapters``) LoRA on, at the
        actor's rank and targets; with router replay (``actor.router_replay.mode = "R3"``) the
        routed experts returned; when the sync plan pauses engines ``in_place`` (``in_place``, or
        per_request with in_place survivors) the radix cache and overlap scheduler off, as the
        sync agent requires (``asyncrl.sync_control.pause_policy.IN_PLACE_FLAGS``). The engine
        keys are not given to it."""
        from asyncrl.sync_control.pause_policy import plan_for

        lora = {}
        if cfg.syncs_adapters:
            targets = cfg.actor.target_modules
            lora = {"enable_lora": True, "max_lora_rank": cfg.actor.lora_rank,
                    "lora_target_modules": ["all"] if isinstance(targets, str) else list(targets)}
        return cls.model_validate({
            **cfg.engines.local.model_dump(), "model": cfg.model.path, "host": "127.0.0.1", "port": port,
            "dtype": cfg.model.dtype, "seed": cfg.model.seed, "max_model_len": cfg.model.max_model_len,
            "log_level": cfg.run.log_level.lower(), "log_json": cfg.run.log_json, **lora,
            "enable_return_routed_experts": cfg.actor.router_replay.mode == "R3",
            **({"disable_radix_cache": True, "disable_overlap_schedule": True}
               if plan_for(cfg.sync, cfg.async_training).engine_mode == "in_place" else {}),
        })


def build_parser() -> argparse.ArgumentParser:
    """The ``asyncrl engine`` parser: one flag per field of :class:`EngineSettings`."""
    p = argparse.ArgumentParser(prog="asyncrl engine", description="CPU inference engine speaking SGLang's HTTP protocol "
                                "(docs/local_engine.md). Every flag is a field of local_engine.settings.EngineSettings.")
    add_flags(p, EngineSettings, groups={"timing": "timing mode (no model compute; for system benchmarks)"})
    return p
