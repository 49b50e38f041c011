"""What the rollout service tells its verifiers driver: :class:`DriverSpec`.

The supervisor writes it as JSON into the driver's state directory and passes its path on
the command line; the session API token travels in the environment variable
:data:`TOKEN_ENV` (never written to disk). One typed contract for both ends of the launch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PREFIX = "verifiers:"
DATA_SOURCE_PREFIX = "verifiers/"
TOKEN_ENV = "ASYNCRL_DRIVER_API_TOKEN"
SPEC_FILE = "spec.json"
PROGRESS_FILE = "progress.json"
INSTALL_HINT = "pip install 'asyncrl[verifiers]' (with the CPU torch constraint: -c constraints/cpu.txt)"


def env_id_of(source: str) -> str:
    """``verifiers:<env id>`` -> ``<env id>``; ValueError for anything else."""
    if not source.startswith(PREFIX) or not source[len(PREFIX):].strip():
        raise ValueError(f"data.source {source!r}: expected 'verifiers:<environment id>'")
    return source[len(PREFIX):].strip()


class DriverSpec(BaseModel):
    """Everything the driver needs; built from the run config by :func:`.supervisor.driver_spec`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    """The rollout service's base URL (its sessions API)."""
    env_id: str
    """Passed to ``verifiers.load_environment``: an installed environment's id or an importable module."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's ``load_environment`` (``data.source_options``)."""
    data_source: str
    """``data_source`` of the published trajectories (``verifiers/<env id>``)."""
    n: int = Field(ge=1)
    """Episodes per dataset row: one group (``rollout.n``)."""
    max_concurrent: int = Field(ge=1)
    """Episodes in flight at once; a group starts only when all its ``n`` fit."""
    total_groups: int | None = Field(None, ge=1)
    """``rollout.total_rollout_steps``: groups to play; None: ``total_epochs`` passes over the rows."""
    total_epochs: int = Field(1, ge=1)
    shuffle: bool = True
    seed: int = 0
    model: str
    """The model name the OpenAI client sends (``api.model_name``)."""
    sampling: dict[str, Any] = Field(default_factory=dict)
    """The environment's ``sampling_args`` (temperature, top_p, max_tokens from ``rollout.sampling``)."""
    state_dir: str
    """Where the driver keeps :data:`PROGRESS_FILE` (its resume point) and its log."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Limit of one HTTP request to the service (a chat completion may wait out a weight sync)."""
    retry_after_cap_s: float = Field(10.0, gt=0)
    """Longest wait between two attempts to open a session the service refused with 429 / 503."""
