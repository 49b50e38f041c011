"""One assistant turn against the engines — the only implementation of the turn loop.

``generate_turn_tokens(state, deps)`` is used by internal agents (:mod:`.loop`), by OpenAI
requests (``rollout_service.openai.turns.run_turn``) and, through its ``on_chunk`` hook, by
streamed OpenAI requests. Each round of the loop: wait for the pause gate → compute the
turn's remaining token budget → name the request (rid ``<prefix><id>.t<turn>.s<segment>``)
→ generate → append the tokens → stop, or go round again. Contract:

- every model token is appended with mask 1, its engine logprob and the integer weight
  version that produced it (``meta_info``; per-token spans when weights changed
  mid-request);
- an aborted generation (a pause for a weight sync, or any engine-side abort) keeps its
  partial tokens; the loop checkpoints (``deps.checkpoint``) when the gate is closed, waits
  for it to open and asks the engine to continue from the full sequence with the rest of the
  turn's budget — no decoded token is lost;
- engine failures (connection lost, 5xx, timeouts: :class:`EngineError`) are retried with
  backoff, on another engine when one is routable, up to ``ENGINE_RETRIES`` times per turn;
  then the agent is DONE with ``finish_reason="error"``. A 4xx from an engine (other than 408
  and 429) is the request's fault and deterministic: never retried, the agent is DONE with
  ``"error"`` at once and ``reward_details["engine_status"]`` holds the status; either way
  ``state.failure`` is ``"engine_error"`` (an infrastructure failure: never trained);
- the sampling parameters each call sent (temperature, top_p, top_k, min_p, after
  ``deps.extra_sampling``) are recorded in ``state.sampling`` for the tokens it produced: a
  new span whenever they differ from the last span's, or whether the call's result carried
  behaviour log-probs (the engine's sampling mask: ``state.behaviour_logprobs``) does;
- with ``on_chunk`` the engine is asked to stream and ``on_chunk`` is awaited with every
  cumulative result *before* its tokens are appended (so ``state.token_ids`` + the result's
  ``output_ids`` is the sequence so far). If a stream breaks after yielding tokens, the
  tokens of its last result are kept (as after an abort — a streaming client has already
  seen them) and the retry continues from them.

- a call whose trajectory the trainer would drop for staleness is not sent: before
  each call ``deps.stale_check(state, budget)`` (between syncs) and ``state.cancelled`` (set by a
  per-request pause, also checked when the call in flight returns) end the agent with
  ``failure = "stale_cancelled"`` (:func:`cancel`); returns ``(None, kept)`` then.

Not covered: retrying a result whose logprobs do not match its tokens (the engine broke
the protocol: :func:`append_model_tokens` raises and the caller ends the agent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from asyncrl.engine_client.errors import EngineError, EngineHTTPError, PausedWhileRouting
from asyncrl.engine_client.types import GenerateResult
from asyncrl.wire import SamplingSpan
from rollout_service.agent.deps import AgentDeps
from rollout_service.agent.routes import extend_routes, route_request
from rollout_service.agent.state import AgentState, Phase

log = logging.getLogger(__name__)

STALE_CANCELLED = "stale_cancelled"  # Trajectory.failure of a trajectory cancelled for staleness
ENGINE_RETRIES = 5  # engine errors tolerated per turn before the agent ends with "error"
ENGINE_RETRY_BACKOFF_S = 0.5  # times the failure count: 0.5 s, 1 s, 1.5 s, ... between tries

ChunkHook = Callable[[GenerateResult], Awaitable[None]]


class StreamBroken(EngineError):
    """A streamed generate call failed after yielding ``partial`` (its last cumulative result)."""

    def __init__(self, cause: EngineError, partial: GenerateResult) -> None:
        super().__init__(str(cause))
        self.partial = partial


def finish(state: AgentState, reason: str, failure: str = "") -> None:
    """End the agent: DONE with ``reason``, no calls pending; ``failure`` names an
    infrastructure failure (``Trajectory.failure``)."""
    state.phase = Phase.DONE
    state.finish_reason = reason
    state.pending_calls = []
    if failure:
        state.failure = failure


def cancel(state: AgentState, why: str) -> None:
    """End the agent as cancelled for staleness (``rollout_service.runner.per_request``): its
    trajectory is published with ``failure = "stale_cancelled"`` and never trained."""
    state.cancelled = why
    state.reward_details["cancelled"] = why
    finish(state, "abort", STALE_CANCELLED)


def turn_budget(state: AgentState, deps: AgentDeps) -> int:
    used_in_turn = len(state.token_ids) - state.turn_start
    return min(
        deps.sampling.max_new_tokens - used_in_turn,
        deps.response_length - state.response_length,
        deps.max_model_len - len(state.token_ids),
    )


def sampling_params(deps: AgentDeps, max_new: int) -> dict:
    s = deps.sampling
    params = {"max_new_tokens": max_new, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
              "stop_token_ids": [deps.chat.eos_token_id], "skip_special_tokens": False, "no_stop_trim": True}
    return {**params, **deps.extra_sampling}


async def generate_turn_tokens(state: AgentState, deps: AgentDeps, extra: dict | None = None, *,
                               on_chunk: ChunkHook | None = None) -> tuple[bool | None, list[GenerateResult]]:
    """Generate one assistant turn onto ``state`` (see the module docstring).

    Returns ``(ended, kept)``: ``ended`` is True when the turn ended with the end-of-turn
    token, False when it hit a token budget, None when the engines kept failing (the state
    is then DONE with ``finish_reason="error"``); ``kept`` are the engine results whose
    tokens were appended, in order. ``extra`` goes into the /generate body.
    """
    kept: list[GenerateResult] = []
    failures = 0
    while True:
        await deps.gate.wait_open()
        max_new = turn_budget(state, deps)
        if max_new <= 0:
            return False, kept
        why = state.cancelled or deps.stale_check(state, max_new)
        if why:
            cancel(state, why)
            return None, kept
        rid = f"{deps.rid_prefix}{state.id}.t{state.assistant_turns}.s{state.segment}"
        t0 = time.monotonic()
        params = sampling_params(deps, max_new)
        try:
            res = await _generate(state, deps, params, rid, extra, on_chunk)
        except PausedWhileRouting:
            continue  # it never reached an engine: back to the gate, which a sync's pause has closed
        except EngineError as exc:
            if isinstance(exc, StreamBroken) and exc.partial.output_ids:
                _keep(state, exc.partial, deps, kept, params, complete=False)
                state.segment += 1
            failures += 1
            refused = isinstance(exc, EngineHTTPError) and 400 <= exc.status < 500 and exc.status not in (408, 429)
            log.warning("agent %s: engine error %d/%d: %s", state.id, failures, ENGINE_RETRIES, exc)
            if refused:
                finish(state, "error", "engine_error")
                state.reward_details["error"] = f"engine refused the request: {exc}"
                state.reward_details["engine_status"] = exc.status
                return None, kept
            if failures >= ENGINE_RETRIES:
                finish(state, "error", "engine_error")
                state.reward_details["error"] = f"engine: {exc}"
                return None, kept
            state.engine_id = None  # let the router pick another engine
            await asyncio.sleep(ENGINE_RETRY_BACKOFF_S * failures)
            continue
        finally:
            state.add_timing("generate", time.monotonic() - t0)
        try:
            _keep(state, res, deps, kept, params)
        except EngineError as exc:  # routed experts missing or malformed: the engine is misconfigured
            log.warning("agent %s: %s", state.id, exc)
            finish(state, "error", "engine_error")
            state.reward_details["error"] = f"engine: {exc}"
            return None, kept
        if state.cancelled:  # a per-request pause cancelled it while the call ran
            cancel(state, state.cancelled)
            return None, kept
        if res.aborted:
            state.segment += 1
            state.resumed_after_abort += 1
            if deps.gate.paused:
                await deps.checkpoint(state)  # parked mid-turn; continues after resume
            continue
        ended = res.finish_reason.type == "stop" and bool(res.output_ids) and res.output_ids[-1] == deps.chat.eos_token_id
        return ended, kept


async def _generate(state: AgentState, deps: AgentDeps, params: dict, rid: str, extra: dict | None,
                    on_chunk: ChunkHook | None) -> GenerateResult:
    """One generate call: plain, or streamed through ``on_chunk``; asking for the routed
    experts of the positions not held yet when the run replays routes (:mod:`.routes`)."""
    if deps.routes is not None:
        extra = {**(extra or {}), **route_request(state)}
    if on_chunk is None:
        return await deps.generator.generate(state, state.token_ids, params, rid, extra)
    last: GenerateResult | None = None
    try:
        async with contextlib.aclosing(deps.generator.generate_stream(state, state.token_ids, params, rid, extra)) as results:
            async for res in results:
                await on_chunk(res)
                last = res
    except EngineError as exc:
        if last is None:
            raise
        raise StreamBroken(exc, last) from exc
    if last is None:
        raise EngineError(f"the engine's stream for {rid} ended without a result")
    return last


def _keep(state: AgentState, res: GenerateResult, deps: AgentDeps, kept: list[GenerateResult], params: dict,
          complete: bool = True) -> None:
    if deps.routes is not None:
        extend_routes(state, res, deps.routes, complete)
    if res.output_ids:
        note_sampling(state, params, behaviour_logprobs=res.sampling_logprobs is not None)
    append_model_tokens(state, res, deps)
    kept.append(res)


def note_sampling(state: AgentState, params: dict, behaviour_logprobs: bool = False) -> None:
    """Record that the next model tokens were sampled with ``params`` (module docstring), their
    behaviour log-probs recorded or not (``SamplingSpan.behaviour_logprobs``). The first span
    starts at offset 0 whatever precedes the first model token (tokens before it are not the
    model's: their parameters are never used)."""
    span = SamplingSpan(start=state.response_length if state.sampling else 0, temperature=float(params.get("temperature", 1.0)),
                        top_p=float(params.get("top_p", 1.0)), top_k=int(params.get("top_k", -1)),
                        min_p=float(params.get("min_p", 0.0)), behaviour_logprobs=behaviour_logprobs)
    last = state.sampling[-1] if state.sampling else None
    if last is not None and (last.temperature, last.top_p, last.top_k, last.min_p, last.behaviour_logprobs) == \
            (span.temperature, span.top_p, span.top_k, span.min_p, span.behaviour_logprobs):
        return
    if last is not None and last.start == span.start:
        state.sampling[-1] = span
    else:
        state.sampling.append(span)


def append_model_tokens(state: AgentState, res: GenerateResult, deps: AgentDeps) -> None:
    logprobs = res.logprobs if res.logprobs is not None or res.output_ids else []  # aborted while queued: no tokens
    if logprobs is None or len(logprobs) != len(res.output_ids):
        raise EngineError(f"engine returned {len(res.output_ids)} tokens without matching logprobs (rid {res.rid})")
    versions = [0 if v is None else v for v in res.token_versions()]  # an engine that names none: 0
    if res.sampling_logprobs is not None:  # the engine's sampling mask: the behaviour log-probs
        offset = state.response_length
        state.behaviour_logprobs.update((offset + i, min(0.0, v)) for i, v in enumerate(res.sampling_logprobs))
    state.token_ids.extend(res.output_ids)
    state.loss_mask.extend([1] * len(res.output_ids))
    state.logprobs.extend(logprobs)
    state.versions.extend(versions)
    state.decoded_tokens += res.completion_tokens
    if versions:
        if state.version_start is None:
            state.version_start = versions[0]
        state.version_end = versions[-1]
    deps.on_tokens(res.completion_tokens, len(res.output_ids))
