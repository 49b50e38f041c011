"""Settings of one local_engine process (parsed from the command line, nothing global)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from local_engine.compat import DEFAULT as DEFAULT_COMPAT
from local_engine.compat import SglangCompat


class EngineSettings(BaseModel):
    """Everything :func:`local_engine.app.create_app` needs to build an engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "builtin:tiny"
    """Model spec for :func:`asyncrl.models.load_model`: ``builtin:tiny``,
    ``builtin:smollm2-135m`` or a local Hugging Face directory."""
    host: str = "127.0.0.1"
    """Interface to listen on. Loopback by default: the admin routes change weights."""
    port: int = Field(30000, ge=0, le=65535)
    """TCP port (SGLang's default is 30000)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype. float32 gives logprobs that match a float32 trainer to ~1e-6;
    bfloat16 is ~2x faster on CPUs with bf16 support."""
    seed: int = 0
    """Initialisation seed of builtin models, and the seed of the engine's sampling RNG."""
    max_batch_size: int = Field(32, ge=1, le=4096)
    """Most requests decoded together in one step; the rest wait in the queue."""
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
    weight_sync_timeout_s: float = Field(300.0, gt=0)
    """Limit of forming a weight group and of each bucket's broadcasts (RELIABILITY T_sync)."""
    pause_drain_timeout_s: float = Field(30.0, gt=0)
    """pause(mode=abort): how long to keep aborting until no /generate is in flight."""
    log_level: str = "info"
    """uvicorn / engine log level."""
    sglang_compat: str = DEFAULT_COMPAT
    """The SGLang release whose protocol behaviour to copy (see :mod:`local_engine.compat`)."""
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
    health_generation: bool = True
    """SGLang's ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``: ``/health`` behaves like
    ``/health_generate`` (waits behind a pause) unless false."""
    health_check_timeout_s: float = Field(20.0, gt=0)
    """SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT``: ``/health_generate`` answers 503 after this."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the model runs. Weight-update groups are gloo (CPU) either way."""
    timing: dict | None = None
    """Timing mode (no model compute; see :mod:`local_engine.simulated`): the fields of
    ``TimingSpec``. None: the real model."""

    @field_validator("sglang_compat")
    @classmethod
    def _known_release(cls, v: str) -> str:
        return SglangCompat.of(v).version

    @property
    def compat(self) -> SglangCompat:
        return SglangCompat.of(self.sglang_compat)
