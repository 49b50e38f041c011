"""The weight-sync messages between the trainer and the sync agent, typed once.

The trainer (``trainer_daemon/sync/agent.py``) sends :class:`SyncRequest` to
``POST /v1/syncs``; the agent (``sync_agent/app.py``) answers :class:`SyncAccepted` (202) or
an error envelope whose ``error.reason`` is one of :data:`REFUSALS`; ``GET /v1/syncs/{id}``
answers :class:`SyncStatus`. The test suite's stand-in agent uses the same types.

A weight version is an integer everywhere in asyncrl and a decimal string only on SGLang's wire
(``weight_version`` of its update calls, ``/model_info`` and every answer's ``meta_info``): the
engine client converts at that wire and nowhere else, with :func:`weight_version_label` (int →
the engine's string) and :func:`weight_version_number` (the engine's string → int,
``"default"`` → 0). What the number means and who owns it: docs/architecture.md, "The weight
version".

Contract of a sync, in one walk (docs/sync_agent.md draws it): the optimizer step makes
version ``v``; the trainer plans buckets (:mod:`asyncrl.weight_sync.buckets`), posts
``SyncRequest(version=v)``; the agent pauses the rollout and the engines, opens their
weight-update sessions, has them join the group when ``group.new``, and for each bucket fires
``/update_weights_from_distributed`` while the trainer broadcasts the bucket's bytes; the last
bucket carries ``weight_version=v``; the agent closes the sessions, resumes the engines
and the rollout at ``v``. The trainer watches :class:`SyncStatus` during its broadcasts and
stops at once when the agent reports ``failing``/``failed``.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from asyncrl.wire.rollout_admin import PauseOutcome

DEFAULT_GROUP_NAME = "weight_update_group"
"""SGLang's default name of the weight-update process group."""


def fresh_group_name(base: str = DEFAULT_GROUP_NAME) -> str:
    """``base-<8 hex>``: every weight group a trainer forms gets a name of its own. torch (and
    so SGLang) refuses to create a group under a name it still holds, and a destroy that failed
    (an engine cut off mid-sync) leaves the old name held until the engine restarts."""
    import secrets

    return f"{base}-{secrets.token_hex(4)}"

SYNC_PHASES = ("queued", "staging", "pausing", "awaiting_broadcast", "loading", "failing", "resuming")
"""Non-final states of a sync, in order (``staging``: an adapter sync loads the adapter beside
the current one before anything pauses; ``failing``: an engine failed, containment runs)."""
SYNC_FINAL = ("succeeded", "failed")
REFUSALS = ("stale", "regroup", "recovering", "no_engines", "layout", "nccl_mismatch", "pause_policy")
"""``error.reason`` of a refused ``POST /v1/syncs`` (409 or 503): an older version, a group the
engines left, an unfinished sync being recovered, no live engine, an engine layout SGLang
cannot update, NCCL versions that cannot form one communicator, a pause policy an engine's
release cannot run honestly (``asyncrl.sync_control.pause_policy.policy_problems``)."""

_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
                "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a dtype name as SGLang's bodies carry it (``"bfloat16"``)."""
    key = name.removeprefix("torch.")
    if key not in _DTYPE_SIZES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(_DTYPE_SIZES))}")
    return _DTYPE_SIZES[key]


def weight_version_label(version: int) -> str:
    """The string an engine stores for weight version ``version`` (SGLang's ``weight_version``)."""
    return str(int(version))


def weight_version_number(raw: object) -> int:
    """An engine's ``weight_version`` as an int: ``"7"`` → 7; ``"default"``, None, junk → 0."""
    try:
        return max(0, int(str(raw)))
    except (TypeError, ValueError):
        return 0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GroupSpec(_Strict):
    """Where the trainer hosts the weight-update group (it is rank 0)."""

    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    backend: Literal["gloo", "nccl"] = "gloo"
    world_size: int | None = Field(None, ge=2)
    """The trainer's expectation (1 + engine ranks), when it knows; the agent answers the truth."""
    group_name: str = Field(DEFAULT_GROUP_NAME, pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    new: bool = False
    """True when the trainer hosts a fresh group for this sync (the engines must join it)."""
    nccl_version: str | None = Field(None, max_length=32)
    """The trainer's NCCL (``torch.cuda.nccl.version()`` as ``"2.27.5"``), with backend nccl."""
    torch_version: str | None = Field(None, max_length=64)
    """The trainer's torch (``torch.__version__``), to compare with the engines' pinned torch."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.master_address, self.master_port)


class BucketSpec(_Strict):
    """One flattened bucket: tensors packed back to back as bytes, in ``names`` order."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(min_length=1)
    shapes: list[list[int]] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> BucketSpec:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        offset = 0
        for name, dtype, shape in zip(self.names, self.dtypes, self.shapes):
            size = dtype_itemsize(dtype)  # raises on an unknown dtype
            if any(dim < 0 for dim in shape):
                raise ValueError(f"{name}: shapes must be non-negative")
            if offset % size:
                raise ValueError(f"{name}: byte offset {offset} is not aligned to {dtype} (SGLang refuses it)")
            offset += math.prod(shape) * size
        return self

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * dtype_itemsize(d) for d, s in zip(self.dtypes, self.shapes))


class ReloadSpec(_Strict):
    """A full checkpoint of the trainer's weights engines can reload from after a failure."""

    path: str = Field(min_length=1)
    version: int = Field(ge=0, le=2**63 - 1)


ADAPTER_NAME = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,159}$"
"""An adapter's name: engines key adapters by it; never dot-led (no ``..``), never a path."""


def adapter_name(run_id: str, version: int) -> str:
    """The name version ``version``'s LoRA adapter is loaded under on every engine, and that
    the rollout service sends as ``lora_path`` (``<run id>-v<version>``)."""
    return f"{run_id}-v{version}"


def adapter_version(run_id: str, name: str) -> int | None:
    """The inverse of :func:`adapter_name`: the version of run ``run_id``'s adapter ``name``, or
    None when ``name`` is not one of this run's adapters."""
    prefix = f"{run_id}-v"
    tail = name[len(prefix):] if name.startswith(prefix) else ""
    return int(tail) if tail.isascii() and tail.isdigit() else None


class AdapterSpec(_Strict):
    """A LoRA adapter to load on every engine (``sync.lora_weights = adapter``): peft's
    ``adapter_config.json`` and its tensors as ``/load_lora_adapter_from_tensors`` takes them
    (:func:`asyncrl.weight_sync.adapter.encode_adapter`), and/or a peft directory the engines
    can read (``/load_lora_adapter``; older SGLang releases, ``sync.adapter_transport``)."""

    name: str = Field(pattern=ADAPTER_NAME)
    config: dict[str, Any]
    tensors: str | None = None
    checksums: dict[str, str] | None = None
    """sha256 of each tensor's bytes (SGLang's ``expected_checksums``)."""
    path: str | None = Field(None, min_length=1)
    nbytes: int = Field(0, ge=0)
    """The adapter's tensor bytes (for metrics)."""

    @model_validator(mode="after")
    def _somewhere(self) -> AdapterSpec:
        if self.tensors is None and self.path is None:
            raise ValueError("an adapter needs its tensors or a path the engines can read")
        for key in ("r", "lora_alpha", "target_modules"):
            if key not in self.config:
                raise ValueError(f"config (adapter_config.json) lacks {key!r}")
        return self


class SyncRequest(_Strict):
    """``POST /v1/syncs``: make every engine serve these buckets as ``version`` — or, with
    ``adapter`` (no group, no buckets), load this LoRA adapter on every engine as ``version``."""

    version: int = Field(ge=1, le=2**63 - 1)  # int63: a 2^70 once wedged every later sync (issue 48)
    group: GroupSpec | None = None
    buckets: list[BucketSpec] = Field(default_factory=list)
    reload: ReloadSpec | None = None
    adapter: AdapterSpec | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> SyncRequest:
        if self.adapter is not None:
            if self.group is not None or self.buckets:
                raise ValueError("an adapter sync has no group and no buckets")
        elif self.group is None or not self.buckets:
            raise ValueError("a weight sync needs group and at least one bucket (or an adapter)")
        return self


class SyncAccepted(BaseModel):
    """The 202 answer: the sync is queued; ``join_group`` says whether the engines will join
    the request's group (it must equal ``group.new``, else the trainer re-forms)."""

    id: str
    state: str
    world_size: int
    join_group: bool


class SyncStatus(BaseModel):
    """``GET /v1/syncs/{id}``: one sync's life (``engines``: id → loaded | mixed | unchanged)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    version: int
    state: str
    error: str | None = None
    previous_version: int = 0
    join_group: bool = False
    created_at: float = 0.0
    finished_at: float | None = None
    phase_seconds: dict[str, float] = Field(default_factory=dict)
    bytes: int = 0
    buckets: int = 0
    gb_per_s: float | None = None
    engines: dict[str, str] = Field(default_factory=dict)
    resumed_at_version: int | None = None
    pause_outcome: PauseOutcome | None = None
    """What the rollout service's ``per_request`` pause decided (None: another policy)."""

    @property
    def failing(self) -> bool:
        """The agent gave up on this sync (a sender still broadcasting should stop)."""
        return self.state in ("failing", "failed")


class EngineView(BaseModel):
    """One engine as the sync agent sees it (``GET /status``'s ``engines``): the rollout
    service's state for it (``rollout_state``, ``reason``), whether it answers ``/model_info``
    (``alive``) and the version it reports, whether it awaits a reload (it may hold mixed
    weights) and, when quarantined, why it is still out and what brings it back."""

    model_config = ConfigDict(extra="ignore")

    id: str
    url: str
    rollout_state: str
    reason: str | None = None
    alive: bool = False
    version: int | None = None
    needs_reload: bool = False
    held_because: str | None = None


class AgentStatus(BaseModel):
    """``GET /status`` of the sync agent: the weight version the agent holds (``version``: what
    the engines serve after its last successful sync; ``accepted_version``: a sync it accepted
    and runs), whether engines wait for a full push, and its views (engines, group, syncs,
    health) as plain data for people and dashboards. The trainer reads the first three."""

    model_config = ConfigDict(extra="ignore")

    version: int = Field(0, ge=0)
    accepted_version: int = Field(0, ge=0)
    push_wanted: bool = False
    pause_mode: str | None = None
    health: dict[str, Any] = Field(default_factory=dict)
    group: dict[str, Any] | None = None
    running: str | None = None
    queued: int = 0
    needs_reload: list[str] = Field(default_factory=list)
    engines: list[EngineView] = Field(default_factory=list)
    rollout_error: str | None = None
    """Why the rollout service did not answer the agent (``engines`` is then empty)."""
    syncs: list[dict[str, Any]] = Field(default_factory=list)

    @property
    def newest_version(self) -> int:
        """The newest version the agent knows of: served, or accepted and under way."""
        return max(self.version, self.accepted_version)


class SyncRefusal(BaseModel):
    """A refused ``POST /v1/syncs`` (409 or 503): the error envelope's ``error`` object, with
    ``reason`` one of :data:`REFUSALS` and, for ``stale``, ``current_version`` (the version the
    trainer must move past). :meth:`parse` reads an answer's body; None when it is not one."""

    model_config = ConfigDict(extra="ignore")

    message: str = ""
    reason: str
    current_version: int | None = None

    @classmethod
    def parse(cls, status: int, body: str | bytes) -> SyncRefusal | None:
        if status not in (409, 503):
            return None
        try:
            error = json.loads(body).get("error")
            return cls.model_validate(error) if isinstance(error, dict) and error.get("reason") in REFUSALS else None
        except (ValueError, AttributeError, ValidationError):
            return None
