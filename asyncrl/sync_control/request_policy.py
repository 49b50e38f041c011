"""The per-request interrupt rule at a weight sync (issue 51, ``sync.pause_policy = "per_request"``):
one decision per generate call in flight, instead of one mode for everything.

Outcomes:

- ``cancel``: the call's trajectory would not be trained: at the version it is expected to be
  trained at — the new version plus the versions the trainer is expected to add while the
  call decodes its expected rest (``syncs_ahead``) — its oldest token would lag more than the
  trainer accepts (``max_lag``, the trainer's own bound from ``async_training.staleness_threshold``:
  ``asyncrl.config.run_config.max_version_lag``), so the trainer would drop what it decodes.
  Only under the trainer's ``drop`` policy with the ``oldest`` age (otherwise its tokens could
  still count: never cancelled then). With ``syncs_ahead = 0`` the drop is certain; beyond it,
  a projection. Its sample's place in the staleness quota is given back; it is published
  marked ``stale_cancelled`` and never trained.
- ``keep``: it goes on under the engine-wide survivor mode (``in_place`` or ``retract``: an
  engine pauses as a whole): nearly done (``progress >= keep_min_progress``, the share of its
  expected length already decoded: finishing its few tokens under the old weights costs less
  than re-prefilling it) or too long to re-prefill
  (``context > resume_max_context``).
- ``resume``: aborted by its exact rid and resent after the sync (partial rollout: its decoded
  tokens kept, per-token versions recorded), so the rest of it is decoded by the new weights.

Between syncs the same bound cancels a call that is already too stale to train
(:meth:`RequestRule.too_stale`), instead of letting it decode to the end to be dropped.

Inputs per call (:class:`CallFacts`): the trajectory's oldest version, the turn's tokens decoded
so far (the call in flight's own tokens are estimated by the caller from its elapsed time: a
non-streamed ``/generate`` shows nothing until it returns), the tokens it may still decode
(its budget) and is expected to (from the lengths of finished turns), its context length, and
the versions expected before it is trained. Pure and torch-free: the rollout service applies
it (``rollout_service.runner.per_request``); docs/sync_agent.md, "Per-request pauses".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Outcome = Literal["keep", "resume", "cancel"]


@dataclass(frozen=True)
class CallFacts:
    """One generate call in flight, as the rollout service knows it."""

    rid: str
    start_version: int
    """The oldest weight version among its trajectory's tokens (``version_start``)."""
    decoded: int
    """Tokens of its turn so far, the call's own estimated ones included."""
    remaining: int
    """Tokens it may still decode (its budget left: ``max_new_tokens`` of the call minus the
    estimate, bounded by the response length)."""
    context: int
    """Tokens in its context (prompt and response so far)."""
    expected_remaining: int | None = None
    """Tokens it is expected to decode still (None: its whole budget ``remaining``)."""
    syncs_ahead: int = 0
    """Versions the trainer is expected to add after the sync before this call's trajectory is
    trained (0: judged at the sync's version alone, which makes a cancel certain)."""

    @property
    def expected_rest(self) -> int:
        return self.remaining if self.expected_remaining is None else min(self.remaining, self.expected_remaining)

    @property
    def progress(self) -> float:
        """Share of its expected turn already decoded (1.0 when nothing remains)."""
        total = self.decoded + self.expected_rest
        return 1.0 if total <= 0 else self.decoded / total


@dataclass(frozen=True)
class RequestRule:
    """The rule's settings (module docstring). ``max_lag`` None: nothing is ever cancelled for
    staleness (the trainer would train any age: ``downweight``, ``token_mean``, no bound)."""

    max_lag: int | None
    keep_min_progress: float = 0.5
    resume_max_context: int = 2048

    def __post_init__(self) -> None:
        if self.max_lag is not None and self.max_lag < 0:
            raise ValueError(f"max_lag must be >= 0 or None, not {self.max_lag}")
        if not 0.0 <= self.keep_min_progress <= 1.0:
            raise ValueError(f"keep_min_progress must be within [0, 1], not {self.keep_min_progress}")
        if self.resume_max_context < 0:
            raise ValueError(f"resume_max_context must be >= 0, not {self.resume_max_context}")

    @classmethod
    def from_config(cls, cfg) -> RequestRule:
        """The run's rule: ``derived.stale_cancel_lag`` (None unless the trainer certainly drops
        beyond its bound: ``drop`` on the ``oldest`` age, and ``cancel_stale`` on) and the
        thresholds of ``sync.per_request``."""
        pr = cfg.sync.per_request
        return cls(max_lag=cfg.derived.stale_cancel_lag, keep_min_progress=pr.keep_min_progress,
                   resume_max_context=pr.resume_max_context)

    def stale_reason(self, start_version: int, version: int) -> str:
        """Why a trajectory whose oldest token is of ``start_version`` would be dropped if
        trained at ``version`` or later ("" if it would not)."""
        if self.max_lag is None or version - start_version <= self.max_lag:
            return ""
        return (f"its oldest token (version {start_version}) would lag {version - start_version} versions at "
                f"{version}, beyond the trainer's {self.max_lag}")

    def too_stale(self, facts: CallFacts, version: int) -> bool:
        """Whether a trajectory trained at ``version`` + its ``syncs_ahead`` or later would be
        dropped for staleness."""
        return bool(self.stale_reason(facts.start_version, version + facts.syncs_ahead))

    def decide(self, facts: CallFacts, new_version: int) -> tuple[Outcome, str]:
        """The outcome for one call when a sync to ``new_version`` pauses, and why."""
        why = self.stale_reason(facts.start_version, new_version + facts.syncs_ahead)
        if why:
            return "cancel", why + (f" (trained after ~{facts.syncs_ahead} more versions: its expected "
                                    f"{facts.expected_rest} tokens still to decode)" if facts.syncs_ahead else "")
        if facts.progress >= self.keep_min_progress:
            return "keep", f"{facts.progress:.0%} decoded (>= {self.keep_min_progress:.0%}): finished under the survivor mode"
        if facts.context > self.resume_max_context:
            return "keep", f"context of {facts.context} tokens (> {self.resume_max_context}): re-prefilling costs more"
        return "resume", f"{facts.progress:.0%} decoded: resent after the sync, the rest decoded by version {new_version}"

    def plan(self, calls: list[CallFacts], new_version: int) -> dict[Outcome, list[str]]:
        """Every call's rid by outcome (each rid in exactly one list)."""
        out: dict[Outcome, list[str]] = {"keep": [], "resume": [], "cancel": []}
        for facts in calls:
            out[self.decide(facts, new_version)[0]].append(facts.rid)
        return out
