"""Each token's routed experts, kept with the agent's tokens (issue 53, ``actor.router_replay.mode
= "R3"``): every generate call asks the engine for the routes of the positions no earlier call
computed (``routed_experts_start_len`` = the rows held so far), so a token keeps the routes of
the call that first computed it — across turns, tool results and an abort-and-resume at a sync
(the leading implementations take the last call's routes for the whole prefix: after a resume,
the new weights' routes for tokens the old weights sampled).

The rows a call returns must be exactly the positions it added: its context plus its output,
less the last token, less the rows already held. A call that returns tokens but no routes means
an engine that does not record them (SGLang answers without routes, silently, unless started
with ``--enable-return-routed-experts``): an engine error naming the flag. A stream broken
mid-way keeps its tokens without routes; the next call's rows then cover them (or, with no
next call, they are *no route* rows: routed live by the trainer).

Limits: a ``retract`` pause (the global policy, or per_request's survivor mode) frees a call's
KV, and its re-prefill recomputes every position from the call's start with the new weights:
the routes SGLang then reports for the tokens the old weights sampled are the new weights'
(``num_retractions`` > 0 marks such calls). With router replay prefer ``in_place`` or ``abort``
survivors. The wire's message size bound (``derived.max_message_bytes``) counts the routes under
R3 (``layers × top_k × width`` bytes per token, from the model's config: 8 for
``builtin:tiny-moe``, 384 for a 48-layer top-8 model).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.engine_client import EngineError, GenerateResult
from asyncrl.wire.routed_experts import RoutedExperts, engine_rows, pack_rows, width_for
from rollout_service.agent.state import AgentState


@dataclass(frozen=True)
class RouteShape:
    """The policy's routing: MoE layers counted as the model's ``num_hidden_layers`` (a dense
    layer's rows are zeros), experts per token, bytes per expert id on the wire."""

    layers: int
    top_k: int
    width: int

    @classmethod
    def of(cls, model_config) -> RouteShape:
        """From a transformers config; ValueError for a model without routed experts."""
        top_k = getattr(model_config, "num_experts_per_tok", None)
        experts = getattr(model_config, "num_experts", None) or getattr(model_config, "n_routed_experts", None)
        if not top_k or not experts:
            raise ValueError(f"actor.router_replay.mode R3 needs a mixture-of-experts model; {type(model_config).__name__} "
                             "has no routed experts (num_experts_per_tok)")
        return cls(int(model_config.num_hidden_layers), int(top_k), width_for(int(experts)))


def held_rows(state: AgentState) -> int:
    return state.routed_experts.num_rows if state.routed_experts is not None else 0


def route_request(state: AgentState) -> dict:
    """The ``/generate`` fields that ask for the routes of the positions not held yet."""
    return {"return_routed_experts": True, "routed_experts_start_len": held_rows(state)}


def extend_routes(state: AgentState, res: GenerateResult, shape: RouteShape, complete: bool = True) -> None:
    """Append ``res``'s routes (call before its tokens are appended); ``complete`` False for a
    broken stream's partial result (no routes expected)."""
    if res.aborted and (res.routed_experts is None or not res.output_ids):
        # aborted while queued (before it decoded, or after a retract freed its KV and rows): SGLang
        # answers without routes; the resumed call asks from the rows held, so its rows cover them
        return
    if res.routed_experts is None or not complete:  # a broken stream's partial: the next call's rows cover it
        if res.output_ids and complete:
            raise EngineError(f"asked for routed experts, the engine answered none for {res.rid}: start it with "
                              "--enable-return-routed-experts (SGLang answers without routes, silently)")
        return
    try:
        rows = engine_rows(res.routed_experts, shape.layers, shape.top_k)
    except ValueError as exc:
        raise EngineError(f"routed_experts of {res.rid}: {exc}") from None
    start = held_rows(state)
    expected = len(state.token_ids) + len(res.output_ids) - 1 - start
    if rows.shape[0] != max(0, expected):
        raise EngineError(f"routed_experts of {res.rid} hold {rows.shape[0]} rows; positions {start} to "
                          f"{len(state.token_ids) + len(res.output_ids) - 2} need {max(0, expected)}")
    try:
        packed = pack_rows(rows, shape.width)
    except ValueError as exc:
        raise EngineError(f"routed_experts of {res.rid}: {exc}") from None
    held = state.routed_experts.rows if state.routed_experts is not None else b""
    state.routed_experts = RoutedExperts(layers=shape.layers, top_k=shape.top_k, width=shape.width, rows=held + packed)


def trajectory_routes(state: AgentState) -> RoutedExperts | None:
    """The trajectory's routes: one row per position but the last; positions no call reported
    (environment tokens after the last call, a broken stream's tokens) as *no route* rows, which
    the trainer routes live (module docstring of the wire field)."""
    r = state.routed_experts
    if r is None:
        return None
    need = max(0, len(state.token_ids) - 1) * r.row_bytes
    rows = r.rows[:need] + bytes([255]) * max(0, need - len(r.rows))  # every byte 255: no_route(width)
    return RoutedExperts(layers=r.layers, top_k=r.top_k, width=r.width, rows=rows)
