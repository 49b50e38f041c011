"""Settings of one local_engine process (parsed from the command line, nothing global)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
    timing: dict | None = None
    """Timing mode (no model compute; see :mod:`local_engine.simulated`): the fields of
    ``TimingSpec``. None: the real model."""
