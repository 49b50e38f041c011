"""Issue 53, the rollout side on fixed values: each call asks for the routes of the positions
not held yet, so a token keeps the routes of the call that first computed it (a resume after
an abort keeps the rows decoded before it); rows that do not fit the call, or tokens without
routes, are an engine error naming the flag; the trajectory carries one row per position but
the last (positions no call computed as zeros), and the wire refuses rows that do not fit."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from asyncrl.engine_client import EngineError, FinishReason, GenerateResult
from asyncrl.wire import RoutedExperts, Trajectory, decode_trajectory, encode_trajectory
from asyncrl.wire.routed_experts import no_route, width_for
from rollout_service.agent.routes import RouteShape, extend_routes, route_request, trajectory_routes
from rollout_service.agent.state import AgentState

SHAPE = RouteShape(layers=2, top_k=2, width=1)


def state(tokens: int) -> AgentState:
    return AgentState(id="a", run_id="r", group_id="g", group_size=1, group_index=0, prompt_id="p", data_source="d",
                      token_ids=list(range(tokens)), prompt_length=tokens)


def result(rows: np.ndarray | None, out: int, rid: str = "c", finish: str = "stop") -> GenerateResult:
    text = None if rows is None else base64.b64encode(rows.astype("<i4").tobytes()).decode()
    return GenerateResult(rid=rid, text="", output_ids=list(range(out)), logprobs=[-0.1] * out,
                          finish_reason=FinishReason(finish), weight_version=0, prompt_tokens=None, completion_tokens=out,
                          cached_tokens=0, routed_experts=text)


def rows_of(first: int, n: int) -> np.ndarray:
    """``n`` distinct rows for positions ``first``.. (expert ids encode the position)."""
    pos = np.arange(first, first + n).reshape(-1, 1, 1) % 8
    return np.broadcast_to(pos, (n, SHAPE.layers, SHAPE.top_k)).copy()


def positions(s: AgentState) -> list[int]:
    return s.routed_experts.array()[:, 0, 0].tolist()


def test_each_call_adds_the_rows_of_the_positions_it_computed_first():
    s = state(5)
    assert route_request(s) == {"return_routed_experts": True, "routed_experts_start_len": 0}
    extend_routes(s, result(rows_of(0, 5 + 3 - 1), 3), SHAPE)  # prompt 5, 3 tokens: positions 0..6
    s.token_ids += [1, 2, 3]
    assert s.routed_experts.num_rows == 7 and route_request(s)["routed_experts_start_len"] == 7
    s.token_ids += [9, 9]  # a tool result: computed first by the next call
    extend_routes(s, result(rows_of(7, 10 + 2 - 1 - 7), 2), SHAPE)
    s.token_ids += [4, 5]
    assert positions(s) == [p % 8 for p in range(11)]


def test_a_resumed_call_keeps_the_rows_decoded_before_the_abort():
    s = state(4)
    before = rows_of(0, 4 + 6 - 1)
    extend_routes(s, result(before, 6), SHAPE)  # aborted at a sync after 6 tokens
    s.token_ids += list(range(6))
    new_weights = (rows_of(9, 10 + 4 - 1 - 9) + 3) % 8  # the resume: other weights route differently
    extend_routes(s, result(new_weights, 4), SHAPE)
    got = s.routed_experts.array()
    assert (got[:9] == before).all(), "the old weights' rows stay with the tokens they sampled"
    assert (got[9:] == new_weights).all()


def test_rows_that_do_not_fit_or_tokens_without_routes_are_engine_errors():
    s = state(4)
    with pytest.raises(EngineError, match="need 6"):
        extend_routes(s, result(rows_of(0, 5), 3), SHAPE)
    with pytest.raises(EngineError, match="--enable-return-routed-experts"):
        extend_routes(s, result(None, 3), SHAPE)
    extend_routes(s, result(None, 0, finish="abort"), SHAPE)  # aborted while queued: no tokens, no routes
    extend_routes(s, result(rows_of(0, 0), 0, finish="abort"), SHAPE)  # or an empty payload: nothing to keep either
    extend_routes(s, result(None, 3, finish="abort"), SHAPE)  # retracted, then aborted while queued: tokens, no routes
    with pytest.raises(EngineError, match="need 3"):
        extend_routes(s, result(rows_of(0, 0), 0), SHAPE)  # a finished call with no rows for its prompt is an error
    extend_routes(s, result(None, 3), SHAPE, complete=False)  # a broken stream's partial: the next call covers it
    assert s.routed_experts is None
    with pytest.raises(EngineError, match="expert ids"):
        extend_routes(s, result(rows_of(0, 6) + 300, 3), SHAPE)


def test_the_trajectory_carries_one_row_per_position_but_the_last():
    s = state(4)
    extend_routes(s, result(rows_of(0, 4 + 2 - 1), 2), SHAPE)
    s.token_ids += [1, 2, 7, 7]  # two environment tokens after the last call
    r = trajectory_routes(s)
    assert r.num_rows == len(s.token_ids) - 1 and (r.array()[5:] == no_route(1)).all(), "no route: the trainer routes them live"
    traj = Trajectory(id="t", run_id="r", group_id="g", group_size=1, group_index=0, prompt_id="p", data_source="d",
                      token_ids=s.token_ids, prompt_length=4, loss_mask=[1, 1, 0, 0], rollout_logprobs=[-0.1, -0.1, 0, 0],
                      weight_versions=[0, 0, -1, -1], routed_experts=r)
    back = decode_trajectory(encode_trajectory(traj))
    assert back.routed_experts == r and len(encode_trajectory(traj)) - len(encode_trajectory(
        Trajectory(**{f: getattr(traj, f) for f in traj.__struct_fields__ if f != "routed_experts"}))) <= 7 * 2 * 2 + 64, \
        "layers x top_k bytes per token, and a fixed header"
    with pytest.raises(ValueError, match="routed_experts holds"):
        Trajectory(**{**{f: getattr(traj, f) for f in traj.__struct_fields__}, "routed_experts": RoutedExperts(
            layers=2, top_k=2, width=1, rows=r.rows[:-4])})
    assert width_for(255) == 1 and width_for(256) == 2, "the width's largest id stays free for 'no route'"


def test_the_message_size_bound_counts_the_routes_under_r3(tmp_path):
    """A Qwen3-30B-A3B-like shape (48 layers, 8 of 128 experts: 384 route bytes per token): a
    full context with every route row exceeds the bound without routes and fits the R3 bound."""
    from transformers import Qwen3MoeConfig

    from asyncrl.config import load_config

    Qwen3MoeConfig(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8, hidden_size=64, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=1000).save_pretrained(tmp_path / "moe")
    n = 8192
    base = [f"model.path={tmp_path / 'moe'}", f"model.max_model_len={n}"]
    plain = load_config(overrides=base, environ={}).derived.max_message_bytes
    replay = load_config(overrides=[*base, "actor.router_replay.mode=R3"], environ={}).derived.max_message_bytes
    assert replay - plain == n * 48 * 8  # tokens x layers x top_k x 1-byte ids
    rows = np.full((n - 1, 48, 8), 7, dtype="<u1").tobytes()  # worst-case tokens: 5-byte ids, full log-probs, versions
    fields = dict(id="t" * 64, run_id="r", group_id="g", group_size=1, group_index=0, prompt_id="p", data_source="d",
                  token_ids=[100_000] * n, prompt_length=1, loss_mask=[1] * (n - 1), rollout_logprobs=[-1.2345678e-3] * (n - 1),
                  weight_versions=[1_000_000] * (n - 1))
    text = 16 * n  # the bound's allowance for the optional debug text
    dense = len(encode_trajectory(Trajectory(**fields))) + text
    routed = len(encode_trajectory(Trajectory(**fields, routed_experts=RoutedExperts(layers=48, top_k=8, width=1, rows=rows)))) + text
    assert dense <= plain < routed <= replay, (dense, plain, routed, replay)


async def test_an_engine_that_cannot_return_routes_never_serves_a_routing_replay_run(warm_engine):
    """Issue 66 N3, N4, judged from ``/server_info`` at the engine's first health check: under
    R3 an engine started without ``--enable-return-routed-experts`` (a real local engine) is
    unhealthy with the flag named, so no call goes to it (instead of every call failing on
    its answer); one reporting ``--enable-hierarchical-cache`` is refused too; the same engine
    serves a run without R3."""
    from asyncrl.config import load_config
    from rollout_service.engines import EnginePool
    from rollout_service.engines.fitness import EngineRequirements, routes_problem

    r3 = EngineRequirements.of(load_config(None, ["actor.router_replay.mode=R3"], environ={}).actor)
    plain = EngineRequirements.of(load_config(None, [], environ={}).actor)
    for needs, fit in ((r3, False), (plain, True)):
        pool = EnginePool(requirements=needs)
        try:
            handle = pool.add(warm_engine)
            await pool.check_once()
            assert (handle.state == "healthy") == fit, (handle.state, handle.unfit)
            if not fit:
                assert "--enable-return-routed-experts" in handle.unfit and "--enable-return-routed-experts" in handle.reason
        finally:
            await pool.close()
    assert "--enable-hierarchical-cache" in routes_problem({"enable_return_routed_experts": True,
                                                            "enable_hierarchical_cache": True})
    assert routes_problem({"enable_return_routed_experts": True, "enable_hierarchical_cache": False}) is None
    assert routes_problem({}) is None  # not reported: not judged
