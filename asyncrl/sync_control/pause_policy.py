"""What a weight sync does with the generations in flight: the one place this rule lives.

``sync.pause_policy`` applies when partial rollout is active
(``async_training.partial_rollout_active``); otherwise the rollout service drains before the
sync, nothing is in flight, and the engines are paused with ``abort`` (a no-op then).

========== ======================== ======================= ====================================
policy     rollout service pause    engines' pause          after the update
========== ======================== ======================= ====================================
abort      ``partial``: abort this  ``abort``               flush the prefix cache (retried
           service's requests by                            while aborted requests drain); the
           exact rid; agents keep                           rollout resends prompt + kept tokens
           their tokens and resend                          (re-prefilled with the new weights)
           after the sync
retract    ``hold``: stop admitting ``retract``: requests   flush once (SGLang 0.5.21+ flushes a
           new work, keep the calls stay queued, KV freed   paused engine with a queue); the
           that are in flight                               engine re-prefills the requests
                                                            (refused before 0.5.21: below)
in_place   ``hold``                 ``in_place``: requests  no flush (SGLang refuses one while
                                    and KV kept             requests run): generation goes on
                                                            over KV computed with the old weights
per_request ``per_request``: abort  the survivor mode       as the survivor mode
           by exact rid the calls   (``sync.per_request``:
           the rule resumes or      ``in_place`` or
           cancels; keep the rest   ``retract``) for the
           (``request_policy``)     calls kept
========== ======================== ======================= ====================================

Per-token weight versions record the switch in every case (the engine's ``weight_versions``
spans under retract and in_place; the resumed request's version under abort). What each
policy costs and when it is safe: docs/sync_agent.md, "Pause policies".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.sync_control.engine_update import FLUSH_RETRIES

PausePolicyName = Literal["abort", "retract", "in_place", "per_request"]
EngineMode = Literal["abort", "retract", "in_place"]


@dataclass(frozen=True)
class PausePlan:
    """The calls one sync makes (module docstring)."""

    policy: PausePolicyName
    rollout_mode: Literal["partial", "drain", "hold", "per_request"]
    engine_mode: EngineMode
    flush_retries: int
    """0: no ``/flush_cache``; 1: one try; more: retried while the engine answers 400."""


def pause_plan(policy: PausePolicyName, partial_rollout_active: bool, survivor_mode: EngineMode = "in_place") -> PausePlan:
    """The plan for ``sync.pause_policy`` given whether partial rollout is active;
    ``survivor_mode``: ``sync.per_request.survivor_mode``."""
    if not partial_rollout_active:
        return PausePlan("abort", "drain", "abort", FLUSH_RETRIES)
    if policy == "per_request":
        if survivor_mode not in ("retract", "in_place"):
            raise ValueError(f"the per_request survivor mode must be retract or in_place, not {survivor_mode!r}")
        survivors = pause_plan(survivor_mode, True)
        return PausePlan("per_request", "per_request", survivors.engine_mode, survivors.flush_retries)
    if policy == "abort":
        return PausePlan("abort", "partial", "abort", FLUSH_RETRIES)
    if policy == "retract":
        return PausePlan("retract", "hold", "retract", 1)
    if policy == "in_place":
        return PausePlan("in_place", "hold", "in_place", 0)
    raise ValueError(f"unknown pause policy {policy!r} (abort, retract or in_place)")


def plan_for(sync, async_training) -> PausePlan:
    """:func:`pause_plan` of a run's ``sync`` and ``async_training`` sections."""
    return pause_plan(sync.pause_policy, async_training.partial_rollout_active, sync.per_request.survivor_mode)


SPANS_FROM = (0, 5, 19)
"""First sglang release whose finished outputs carry ``meta_info.weight_versions`` spans (read
from the wheels: ``compute_weight_version_spans`` in the scheduler's output path)."""
RETRACT_FLUSH_FROM = (0, 5, 21)
"""First sglang release whose cache flush ignores the queue of a paused engine: before it the
flush after a ``retract`` pause is refused while the retracted requests wait, so they re-prefill
over prompt KV the old weights computed, and their log-probs are not the new policy's (nor is a
flush with the update safe: 0.5.19-0.5.20 assert on it and the server exits)."""


IN_PLACE_FLAGS = {
    "radix_cache": ("--disable-radix-cache", "its prefix cache keeps KV the old weights computed (nothing flushes it "
                    "under in_place): a call resent after the sync, or a new one sharing its prompt, would be "
                    "decoded over it and recorded as the new version's"),
    "overlap_schedule": ("--disable-overlap-schedule", "its overlap scheduler still holds each request's last "
                         "old-weight token at an in_place pause and labels it with the new version"),
}
"""The flags an engine needs for the ``in_place`` engine mode (``in_place``, and per_request with
``in_place`` survivors), by :class:`~asyncrl.sync_control.layout.EngineLayout` field: SGLang's
defaults mislabel tokens without them (issue 66 N1, N2; docs/deployment.md)."""


def policy_problems(plan: PausePlan, layouts) -> list[str]:
    """Why ``plan`` cannot run on these engines (``EngineLayout`` s): ``retract`` and
    ``in_place`` keep requests across a sync, so their tokens carry two versions, which only
    the engines' ``weight_versions`` spans tell apart; before :data:`SPANS_FROM` the client
    would label old-weight tokens with the new version. ``retract`` also needs the flush of
    :data:`RETRACT_FLUSH_FROM` (issue 46 item 11: 0.5.19-0.5.20 would record tokens whose
    log-probs mix old prompt KV with new weights as exact). ``in_place`` needs the engines'
    radix cache and overlap scheduler off (:data:`IN_PLACE_FLAGS`). Engines of an unknown
    release pass; an engine that does not report a feature is not judged on it."""
    if plan.engine_mode not in ("retract", "in_place"):
        return []
    from asyncrl.sync_control.layout import parse_version

    out = []
    for layout in layouts:
        if plan.engine_mode == "in_place":
            which = "per_request's in_place survivors" if plan.policy == "per_request" else "sync.pause_policy=in_place"
            for feature, (flag, why) in IN_PLACE_FLAGS.items():
                if getattr(layout, feature, None):
                    out.append(f"engine {layout.engine} runs without {flag}: {why}; {which} needs it (add {flag} "
                               f"to the engine's command line{', or use survivor_mode=retract' if plan.policy == 'per_request' else ''})")
        v = parse_version(layout.version)
        if v is not None and v < SPANS_FROM:
            out.append(f"engine {layout.engine} runs sglang {layout.version}, whose outputs carry no weight_versions spans "
                       f"(from {'.'.join(map(str, SPANS_FROM))}): sync.pause_policy={plan.policy} would label its "
                       f"old-weight tokens with the new version; use pause_policy=abort or sglang >= "
                       f"{'.'.join(map(str, SPANS_FROM))}")
        elif v is not None and plan.engine_mode == "retract" and v < RETRACT_FLUSH_FROM:
            out.append(f"engine {layout.engine} runs sglang {layout.version}, which cannot flush the prompt cache of the "
                       f"requests a retract pause queued (from {'.'.join(map(str, RETRACT_FLUSH_FROM))}): they would "
                       f"resume over prompt KV of the old weights with log-probs recorded as exact; use "
                       f"pause_policy=abort or in_place, or sglang >= {'.'.join(map(str, RETRACT_FLUSH_FROM))}")
    return out
