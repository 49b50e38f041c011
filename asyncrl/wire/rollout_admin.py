"""The rollout service's admin API, typed once for both ends (bearer ``security.admin_token``).

The server (``rollout_service/api/admin.py``) validates the requests with these models and
answers every action with a :class:`RolloutStatus`; the sync agent's client
(``sync_agent/rollout_admin.py``) sends the same requests and parses the same answer.

    POST   /admin/pause                      PauseRequest        → RolloutStatus (504: pause timed out)
    POST   /admin/resume                     ResumeRequest       → RolloutStatus (409: older version)
    GET    /admin/status                                         → RolloutStatus
    POST   /admin/engines                    AddEngineRequest    → RolloutStatus
    DELETE /admin/engines/{id}                                   → RolloutStatus
    POST   /admin/engines/{id}/quarantine    QuarantineRequest   → RolloutStatus (404: unknown engine)
    DELETE /admin/engines/{id}/quarantine                        → RolloutStatus

Requests refuse unknown fields (a misspelt knob is a 400 naming it, not ignored). Answers ignore fields
they do not name, so an older reader keeps working against a newer server; the sections a
reader never acts on (quota, prompts, tokens, publisher, counters, tools, derived numbers) are
JSON objects whose keys are documented where they are produced (docs/rollout_service.md).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator

from asyncrl.engine_urls import url_shape_problem

PauseMode = Literal["partial", "drain", "hold", "per_request"]
EngineRotation = Literal["healthy", "unhealthy", "quarantined"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PauseRequest(_Request):
    mode: PauseMode | None = None
    """None: the mode of the run's pause plan (``asyncrl.sync_control.pause_policy``): ``partial``,
    ``hold`` or ``per_request`` when ``async_training.partial_rollout_active`` (by
    ``sync.pause_policy``), else ``drain``."""
    timeout_s: float | None = Field(None, gt=0, le=3600)
    """How long the pause may take (None: ``rollout.pause_timeout_s``)."""
    version: int | None = Field(None, ge=0, le=2**63 - 1)
    """The version the sync will install: a ``per_request`` pause judges each call's staleness
    against it (None: the current version + 1). The other modes ignore it."""


class ResumeRequest(_Request):
    version: int = Field(ge=0, le=2**63 - 1)  # int63 (issue 48)
    """The weight version the engines now serve; refused (409) when older than the current one."""


class AddEngineRequest(_Request):
    url: HttpUrl
    """The engine's base URL: no user name or password, query or fragment (a 400 naming it)."""
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")

    @field_validator("url")
    @classmethod
    def _base_url_only(cls, v: HttpUrl) -> HttpUrl:
        problem = url_shape_problem(str(v))
        if problem:
            raise ValueError(problem)
        return v


class QuarantineRequest(_Request):
    reason: str = Field("quarantined by an operator", max_length=500)


class EngineState(_Answer):
    """One engine as the rollout service routes to it."""

    id: str
    url: str
    state: EngineRotation
    """``healthy`` (routed to), ``unhealthy`` (failed its health checks), ``quarantined`` (held
    out by an operator or the sync agent until released)."""
    reason: str | None = None
    """Why it is out of rotation; the sync agent's quarantines start with its prefix."""
    inflight: int = 0
    routed: int = 0
    served: int = 0
    weight_version: int | None = None
    """The version the engine reported in its newest-asked answer (None: none yet; an engine
    never synced, SGLang's ``"default"``, is 0)."""
    tokens_decoded: int = 0
    evicted: int = 0
    quarantined_current_s: float = 0.0


class PauseOutcome(_Answer):
    """What the last ``per_request`` pause decided (``rollout_service.runner.per_request``):
    calls kept at their engines, aborted to resume, cancelled for staleness, and aborts that
    did not stop their call in time (``missed``: kept under the survivor mode)."""

    target_version: int
    kept: int = 0
    resumed: int = 0
    cancelled: int = 0
    missed: int = 0
    reprefill_tokens: int = 0
    """Context tokens of the resumed calls: prefilled again on the new weights."""
    cancelled_tokens: int = 0
    """Response tokens the cancelled calls' trajectories had decoded (never trained)."""
    seconds: float = 0.0
    """How long deciding and aborting took (inside the sync's pause window)."""


class StatusCounts(_Answer):
    active: int
    parked: int
    sessions_open: int
    sessions_expired: int
    generating: int
    partial: int
    in_flight_samples: int
    queued_samples: int
    queued_trajectories: int
    stale: int
    outbox: int
    outbox_rejected: int


class RolloutStatus(_Answer):
    """``GET /admin/status``, and the answer of every admin action."""

    run_id: str
    version: int
    """The weight version new tokens are tagged with."""
    paused: bool
    pause_mode: PauseMode | None = None
    paused_for_s: float | None = None
    uptime_s: float
    health: dict[str, Any]
    """The run's health block (docs/operations.md)."""
    counts: StatusCounts
    quota: dict[str, Any]
    admission_blocked: str | None = None
    """Why no new sample starts now (None: one may)."""
    prompts: dict[str, Any]
    tokens: dict[str, Any]
    rollouter: dict[str, Any]
    publisher: dict[str, Any]
    counters: dict[str, Any]
    tools: dict[str, Any]
    engines: list[EngineState]
    derived: dict[str, Any]
    last_validation: dict[str, Any] | None = None
    last_pause: PauseOutcome | None = None
    """The last ``per_request`` pause's decisions (None: none yet)."""
    environment: dict[str, Any] | None = None
    """The verifiers environment's driver, when one plays the run."""

    def engine(self, engine_id: str) -> EngineState | None:
        return next((e for e in self.engines if e.id == engine_id), None)
