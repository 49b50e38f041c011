"""Weight-version bookkeeping of trajectories: staleness, drop rule, partial-rollout metrics.

Inputs per trajectory (the wire ``Trajectory`` fields): ``weight_versions`` (the weight version
that produced each response token, ``-1`` for non-model tokens), ``version_start``,
``version_end``, ``group_id``. Let ``v_min`` / ``v_max`` be the smallest / largest version over
the model tokens (falling back to ``version_start`` / ``version_end`` when there are none) and
``c`` the trainer's current version (the version of the weights the update is applied to).

Definitions:

- *span* = ``v_max - v_min``; a trajectory is *partial* when ``span > 0`` (its generation was
  interrupted by at least one weight sync and resumed, ``partial_rollout``). verl computes it
  as ``|param_version_end - param_version_start|``; the two agree when the wire invariants hold.
- *lag* = ``c - v_max``; the trajectory is *stale* when ``lag >= 1``, i.e. even its newest
  token came from older weights (verl's rule on ``param_version_end``). A partial trajectory
  that finished under the current weights is therefore not stale.
- *oldest lag* = ``c - v_min``; *token age* = the mean of ``c - v`` over its model tokens
  (``v_min`` when it has none): a partial trajectory whose tokens are mostly fresh is young by
  token age and old by oldest lag.
- *age* is one of the two (``async_training.staleness_age``: ``oldest``, the default, or
  ``token_mean``). Beyond the bound (``max_lag`` given and ``age > max_lag``) the trajectory
  is *dropped* (``stale_policy = "drop"``, the default) or *down-weighted*
  (``"downweight"``): its advantage is multiplied by ``weight = decay ** (age - max_lag)``
  (``async_training.stale_decay``); within the bound ``weight = 1``. Dropping is asyncrl's
  rule (verl drops only on a full queue): it bounds how off-policy any token can be, which
  partial rollouts would otherwise leave unbounded.
- A *sample* (group) is stale when its newest token over all trajectories is older than ``c``
  (verl stamps a sample with the rollout version when its last trajectory finished).

:func:`max_version_lag` derives ``max_lag`` from ``staleness_threshold`` ``s``: between two
syncs the rollout starts at most ``(1 + s) N`` samples for ``N`` consumed, so without partial
rollouts a sample is consumed at most ``ceil(s)`` versions after the one that generated it; a
partial trajectory's first tokens can be one more sync older per interruption, hence the
``slack`` argument (asyncrl suggests ``slack=1`` with ``partial_rollout``).

Metrics of one training batch (:func:`batch_version_metrics`, verl's names):
``fully_async/count/stale_samples_processed`` and ``.../stale_trajectory_processed`` are
*running totals* (verl's; pass the previous totals), ``fully_async/count/current_param_version``
is ``c``; ``fully_async/partial/total_partial_num`` (partial trajectories in the batch),
``partial_ratio`` (that / trajectories in the batch, 0 for an empty batch) and
``max_partial_span`` (max span in the batch, 0 if none) describe the batch alone; asyncrl
adds ``fully_async/partial/kept_tokens`` (tokens of the batch's partial trajectories decoded
under an older version than their last one: work a sync did not throw away), and ``fully_async/staleness/oldest_lag_mean`` / ``_max``
and ``token_age_mean`` / ``_max`` of the trained trajectories (their age by either measure).

After a trainer restart that found the engines ahead, version *numbers* jumped (see
``trainer_daemon.state.lineage``): pass ``effective`` (``Lineage.effective``) and every version —
the tokens' and ``c`` — is mapped through it first, so lags count training steps.

Not covered: the rollout-side sample budget itself (the rollout service enforces it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from asyncrl.config.run_config import max_version_lag


class VersionedTrajectory(Protocol):
    weight_versions: Sequence[int]
    version_start: int
    version_end: int
    group_id: Hashable


@dataclass(frozen=True)
class VersionInfo:
    """Version facts of one trajectory relative to the trainer's current version (module doc)."""

    v_min: int
    v_max: int
    span: int
    partial: bool
    lag: int
    oldest_lag: int
    stale: bool
    drop: bool
    token_age: float = 0.0
    age: float = 0.0
    weight: float = 1.0
    """1 within the bound; ``decay ** (age - max_lag)`` beyond it when down-weighting; 0 when dropped."""


@dataclass(frozen=True)
class StalenessBound:
    """How old a trained trajectory may be (module doc): ``max_lag`` (None: unbounded) versions
    of ``age`` (``oldest`` | ``token_mean``); beyond it ``policy`` ``drop`` or ``downweight``
    by ``decay`` per version over the bound."""

    max_lag: int | None = None
    age: str = "oldest"
    policy: str = "drop"
    decay: float = 0.5

    def __post_init__(self) -> None:
        if self.age not in ("oldest", "token_mean") or self.policy not in ("drop", "downweight"):
            raise ValueError(f"unknown staleness age {self.age!r} or policy {self.policy!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    @classmethod
    def from_config(cls, at) -> StalenessBound:
        """From ``AsyncTrainingConfig``: ``max_lag = max_version_lag(staleness_threshold, 1 if
        partial rollout is active else 0)``."""
        lag = max_version_lag(at.staleness_threshold, 1 if at.partial_rollout_active else 0)
        return cls(lag, at.staleness_age, at.stale_policy, at.stale_decay)


def model_version_range(
    weight_versions: Iterable[int], version_start: int, version_end: int
) -> tuple[int, int]:
    """``(v_min, v_max)`` over the model tokens (versions ``>= 0``); ``(version_start, version_end)`` if none."""
    versions = [int(v) for v in weight_versions if int(v) >= 0]
    if not versions:
        return int(version_start), int(version_end)
    return min(versions), max(versions)


def _identity(v: int) -> int:
    return v


def version_info(
    weight_versions: Iterable[int],
    version_start: int,
    version_end: int,
    current_version: int,
    max_lag: int | None = None,
    effective: Callable[[int], int] = _identity,
    bound: StalenessBound | None = None,
) -> VersionInfo:
    """Span, partial, lag, stale, ages, drop and weight of one trajectory (definitions in the
    module doc). ``bound`` overrides ``max_lag`` and sets the age measure and policy."""
    bound = bound or StalenessBound(max_lag)
    versions = [int(v) for v in weight_versions if int(v) >= 0]
    v_min, v_max = (min(versions), max(versions)) if versions else (int(version_start), int(version_end))
    c = effective(current_version)
    token_age = sum(c - effective(v) for v in versions) / len(versions) if versions else float(c - effective(v_min))
    v_min, v_max, current_version = effective(v_min), effective(v_max), c
    lag, oldest = current_version - v_max, current_version - v_min
    age = float(oldest) if bound.age == "oldest" else token_age
    beyond = bound.max_lag is not None and age > bound.max_lag
    drop = beyond and bound.policy == "drop"
    weight = 0.0 if drop else (bound.decay ** (age - bound.max_lag) if beyond else 1.0)
    return VersionInfo(
        v_min=v_min,
        v_max=v_max,
        span=v_max - v_min,
        partial=v_max > v_min,
        lag=lag,
        oldest_lag=oldest,
        stale=lag >= 1,
        drop=drop,
        token_age=token_age,
        age=age,
        weight=weight,
    )


def batch_version_metrics(
    trajectories: Sequence[VersionedTrajectory],
    current_version: int,
    *,
    prev_stale_samples: int = 0,
    prev_stale_trajectories: int = 0,
    effective: Callable[[int], int] = _identity,
) -> dict[str, float]:
    """verl's ``fully_async/count/*`` and ``fully_async/partial/*`` metrics for one batch (module doc)."""
    infos = [
        version_info(t.weight_versions, t.version_start, t.version_end, current_version, effective=effective)
        for t in trajectories
    ]
    reported = current_version
    current_version = effective(current_version)
    newest: dict[Hashable, int] = {}
    for t, info in zip(trajectories, infos, strict=True):
        newest[t.group_id] = max(newest.get(t.group_id, info.v_max), info.v_max)
    stale_traj = sum(info.stale for info in infos)
    stale_samples = sum(current_version - v >= 1 for v in newest.values())
    partial = [info for info in infos if info.partial]
    kept = 0
    for t, info in zip(trajectories, infos, strict=True):
        if info.partial:
            last = max(t.weight_versions)
            kept += sum(1 for v in t.weight_versions if 0 <= v < last)
    return {
        "fully_async/count/stale_samples_processed": float(prev_stale_samples + stale_samples),
        "fully_async/count/stale_trajectory_processed": float(prev_stale_trajectories + stale_traj),
        "fully_async/count/current_param_version": float(reported),
        "fully_async/partial/total_partial_num": float(len(partial)),
        "fully_async/partial/partial_ratio": len(partial) / len(infos) if infos else 0.0,
        "fully_async/partial/max_partial_span": float(max((i.span for i in infos), default=0)),
        "fully_async/partial/kept_tokens": float(kept),
        "fully_async/staleness/oldest_lag_mean": sum(i.oldest_lag for i in infos) / len(infos) if infos else 0.0,
        "fully_async/staleness/oldest_lag_max": float(max((i.oldest_lag for i in infos), default=0)),
        "fully_async/staleness/token_age_mean": sum(i.token_age for i in infos) / len(infos) if infos else 0.0,
        "fully_async/staleness/token_age_max": float(max((i.token_age for i in infos), default=0.0)),
    }
