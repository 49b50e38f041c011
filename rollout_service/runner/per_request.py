"""The rollout side of a per-request pause (``sync.pause_policy = "per_request"``) and the
staleness check between syncs: the rule of :mod:`asyncrl.sync_control.request_policy` applied
to the calls in flight.

At a pause, for the sync to ``target`` (the version the sync agent is about to install):

1. every registered call (:class:`~.inflight.InFlightCalls`) becomes a
   :class:`~asyncrl.sync_control.request_policy.CallFacts`: its trajectory's oldest version
   (when it has no token yet: the version served when the call was sent, which a call kept
   across syncs carries until it ends), tokens decoded (the trajectory's response
   plus the call's own estimate), tokens left (its budget minus the estimate), context;
2. the rule decides ``keep``, ``resume`` or ``cancel`` for each. Only the runner's own agents
   are cancelled (``cancellable``): a session's call belongs to an outside client, which gets
   it resumed instead (the trainer drops it if it comes back too stale);
3. a cancelled call's agent is marked (``AgentState.cancelled``: its next result, aborted or
   not, ends it with ``failure = "stale_cancelled"``: published, never trained);
4. the resumed and cancelled calls are aborted by their exact rids, re-sent for up to
   ``rounds`` × ``interval_s`` while any is still in flight. SGLang 0.5.20+ drops an exact
   abort that arrived before its request was scheduled, and abort-all would take the kept
   calls too, so a call still in flight after the rounds is *missed*: it stays at the engine
   under the survivor mode like a kept call (a missed cancel still ends when it returns).

The gate is closed first (no new call starts), and the kept and missed calls stay at their
engines, which the sync agent then pauses in the survivor mode (``in_place`` or ``retract``).

Between syncs (:func:`stale_reason`): before each generate call an agent whose oldest token
is already beyond the bound at the version now served is cancelled the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from asyncrl import failpoints
from asyncrl.sync_control.request_policy import CallFacts, RequestRule
from asyncrl.wire.rollout_admin import PauseOutcome
from rollout_service.runner.inflight import InFlightCall, InFlightCalls

log = logging.getLogger(__name__)

def projected_syncs(tokens: int, decode_rate: float | None, seconds_per_version: float | None) -> int:
    """Versions the trainer is expected to add while a call decodes ``tokens`` more (0 when the
    rate or the pace is not known yet)."""
    if not decode_rate or not seconds_per_version or tokens <= 0:
        return 0
    return int(tokens / decode_rate / seconds_per_version)


def call_facts(calls: InFlightCalls, call: InFlightCall, current_version: int, now: float,
               seconds_per_version: float | None = None, queue_versions: int = 0) -> CallFacts:
    """What the rule knows of ``call`` at ``now`` (module docstring, step 1); with
    ``seconds_per_version`` the versions expected before its trajectory is trained: the later of
    those the trainer adds while it decodes its expected rest and ``queue_versions``, those it
    needs to consume the whole samples already queued ahead of it (``Runner.queue_versions``)."""
    est = calls.decoded_estimate(call, now)
    state = call.state
    start = state.version_start if state.version_start is not None else min(call.version, current_version)
    decoded = max(0, len(state.token_ids) - state.turn_start) + est
    budget = max(0, call.max_new - est)
    expected = calls.turns.expected_remaining(decoded, budget)
    return CallFacts(rid=call.rid, start_version=start, decoded=decoded, remaining=budget, context=len(state.token_ids) + est,
                     expected_remaining=expected,
                     syncs_ahead=max(projected_syncs(expected, calls.decode_rate, seconds_per_version), queue_versions))


async def pause_per_request(calls: InFlightCalls, rule: RequestRule, target: int, current_version: int,
                            abort_rids: Callable[[set[str]], Awaitable[None]], cancellable: Callable[[Any], bool],
                            rounds: int, interval_s: float, seconds_per_version: float | None = None,
                            queue_versions: int = 0) -> PauseOutcome:
    """Decide over the calls in flight and abort the resumed and cancelled ones (module docstring)."""
    started = time.monotonic()
    out = PauseOutcome(target_version=target)
    to_abort: set[str] = set()
    for call in list(calls.calls.values()):
        facts = call_facts(calls, call, current_version, started, seconds_per_version, queue_versions)
        outcome, why = rule.decide(facts, target)
        if outcome == "cancel" and not cancellable(call.state):
            outcome, why = "resume", f"a session's call ({why}): resumed, the trainer judges it"
        log.debug("per-request pause to %d: %s %s (%s)", target, outcome, call.rid, why)
        if outcome == "keep":
            out.kept += 1
            continue
        to_abort.add(call.rid)
        if outcome == "cancel":
            call.state.cancelled = why
            out.cancelled += 1
            out.cancelled_tokens += facts.decoded
        else:
            out.resumed += 1
            out.reprefill_tokens += facts.context
    await failpoints.hold_async("rollout.per_request_decided")  # tests: a fault between the decisions and the aborts
    for _ in range(rounds):
        left = to_abort & calls.calls.keys()
        if not left:
            break
        await abort_rids(left)
        await asyncio.sleep(interval_s)
    missed = to_abort & calls.calls.keys()
    out.missed = len(missed)
    out.seconds = round(time.monotonic() - started, 3)
    if missed:
        log.info("per-request pause to %d: %d aborts did not stop their calls (kept under the survivor mode): %s",
                 target, len(missed), sorted(missed)[:5])
    return out


def stale_reason(rule: RequestRule | None, state: Any, version: int, syncs_ahead: int = 0) -> str:
    """Why ``state`` must be cancelled before its next call at ``version``, its trajectory
    expected to be trained ``syncs_ahead`` versions later ("" if it may go on: no rule, or no
    token yet)."""
    if rule is None or state.version_start is None:
        return ""
    return rule.stale_reason(state.version_start, version + syncs_ahead)


def between_syncs_check(rule: RequestRule, calls: InFlightCalls, serving, project: bool,
                        queue_versions: Callable[[], int] = lambda: 0) -> Callable[[Any, int], str]:
    """``AgentDeps.stale_check``: :func:`stale_reason` at the version served, projected when
    ``project`` (``sync.per_request.project_versions``) by the turn's expected length and the
    versions the trainer needs for the samples queued ahead (``queue_versions()``)."""
    def check(state: Any, budget: int) -> str:
        ahead = 0
        if project:
            decoded = max(0, len(state.token_ids) - state.turn_start)
            ahead = max(projected_syncs(calls.turns.expected_remaining(decoded, budget), calls.decode_rate,
                                        serving.seconds_per_version), queue_versions())
        return stale_reason(rule, state, serving.version, ahead)

    return check
