"""The Trajectory wire schema: round trips, invariants, and rejection of bad payloads."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.wire import (
    NatsNames,
    SamplingSpan,
    Trajectory,
    WireDecodeError,
    decode_trajectory,
    encode_trajectory,
)


def make(**over) -> Trajectory:
    base = dict(
        id="t-1", run_id="demo", group_id="g-1", group_size=2, group_index=1, prompt_id="p-1", data_source="asyncrl/arith",
        token_ids=[5, 6, 7, 8, 9, 10], prompt_length=2, loss_mask=[1, 1, 0, 1], rollout_logprobs=[-0.1, -2.0, 0.0, -0.3],
        weight_versions=[3, 3, -1, 4], reward=1.0, reward_details={"correct": True}, finish_reason="stop",
        num_turns=2, num_tool_calls=1, version_start=3, version_end=4, temperature=0.9,
    )
    base.update(over)
    return Trajectory(**base)


@st.composite
def trajectories(draw):
    prompt = draw(st.lists(st.integers(0, 200_000), min_size=1, max_size=30))
    resp = draw(st.lists(st.tuples(st.integers(0, 200_000), st.booleans(),
                                   st.floats(-50, 0, allow_nan=False), st.integers(0, 1000)), max_size=40))
    size = draw(st.integers(1, 8))
    return make(
        token_ids=prompt + [r[0] for r in resp], prompt_length=len(prompt),
        loss_mask=[int(r[1]) for r in resp], rollout_logprobs=[r[2] if r[1] else 0.0 for r in resp],
        weight_versions=[r[3] if r[1] else -1 for r in resp], group_size=size, group_index=draw(st.integers(0, size - 1)),
        version_start=0, version_end=1000, messages=draw(st.none() | st.just([{"role": "user", "content": "hi"}])),
    )


@given(trajectories())
def test_round_trip_is_exact(t: Trajectory):
    assert decode_trajectory(encode_trajectory(t)) == t


def test_schema_field_on_the_wire():
    raw = msgspec.msgpack.decode(encode_trajectory(make()))
    assert raw["schema"] == "asyncrl.trajectory/1"


def _mutated(**changes) -> bytes:
    raw = msgspec.msgpack.decode(encode_trajectory(make()))
    raw.update(changes)
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("changes,fragment", [
    ({"schema": "asyncrl.trajectory/2"}, "unsupported trajectory schema version"),
    ({"schema": "something/1"}, "not a trajectory message"),
    ({"prompt_length": "2"}, "$.prompt_length"),
    ({"loss_mask": [1, 1, 0]}, "loss_mask has 3 entries"),
    ({"loss_mask": [1, 2, 0, 1]}, "must be 0 or 1"),
    ({"weight_versions": [3, -1, -1, 4]}, ">= 0 for model tokens"),
    ({"rollout_logprobs": [float("nan"), -2.0, 0.0, -0.3]}, "finite and <= 0"),
    ({"weight_versions": [3, 3, 5, 4]}, "-1 exactly where loss_mask is 0"),
    ({"rollout_logprobs": [0.5, -2.0, 0.0, -0.3]}, "finite and <= 0"),
    ({"group_index": 2}, "group_index"),
    ({"version_start": 9}, "version_start"),
    ({"token_ids": [1, 2, 3, -4, 5, 6]}, "non-negative"),
    ({"finish_reason": "exploded"}, "finish_reason"),
    ({"prompt_length": 0}, "prompt_length"),
    ({"sampling": [{"start": 1, "temperature": 0.5}]}, "sampling span starts must begin at 0"),
    ({"sampling": [{"start": 0}, {"start": 2}, {"start": 2}]}, "increase strictly"),
    ({"sampling": [{"start": 0}, {"start": 5}]}, "stay <= 4"),
    ({"sampling": [{"start": 0, "top_p": 0.0}]}, "invalid parameters"),
    ({"sampling": [{"start": 0, "top_k": 0}]}, "invalid parameters"),
    ({"sampling": [{"start": 0, "temperature": -1.0}]}, "invalid parameters"),
    ({"failure": "gremlins"}, "failure"),
])
def test_malformed_payloads_are_rejected_with_the_reason(changes, fragment):
    with pytest.raises(WireDecodeError) as err:
        decode_trajectory(_mutated(**changes))
    assert fragment in str(err.value)


@pytest.mark.parametrize("payload", [b"", b"\x00\x01garbage", b'{"schema": "asyncrl.trajectory/1"}', msgspec.msgpack.encode([1, 2])])
def test_garbage_is_rejected(payload: bytes):
    with pytest.raises(WireDecodeError):
        decode_trajectory(payload)


def test_missing_required_field_is_named():
    raw = msgspec.msgpack.decode(encode_trajectory(make()))
    del raw["run_id"]
    with pytest.raises(WireDecodeError, match="run_id"):
        decode_trajectory(msgspec.msgpack.encode(raw))


def test_constructor_enforces_invariants():
    with pytest.raises(ValueError, match="rollout_logprobs has 1 entries"):
        make(rollout_logprobs=[-0.1])


def test_derived_properties():
    t = make()
    assert t.response_length == 4 and t.response_ids == [7, 8, 9, 10] and t.num_model_tokens == 3 and t.is_partial


def test_sampling_spans_give_each_response_token_its_logprob_temperature():
    spans = [SamplingSpan(start=0, temperature=0.7), SamplingSpan(start=2, temperature=0.0, top_k=1),
             SamplingSpan(start=3, temperature=1.3, top_p=0.9)]
    t = make(sampling=spans, failure="reward_error")
    assert decode_trajectory(encode_trajectory(t)) == t
    # greedy (T = 0) logprobs are of the raw logits: T = 1 (SGLang's rule)
    assert t.token_temperatures() == [0.7, 0.7, 1.0, 1.3]
    assert t.sampling_truncated  # top_p 0.9 at offset 3; the greedy span's top_k does not count
    assert not make(sampling=spans[:2]).sampling_truncated
    legacy = make()  # no spans: one span of ``temperature`` for the whole response
    assert legacy.token_temperatures() == [0.9] * 4 and not legacy.sampling_truncated and legacy.failure == ""


def test_behaviour_logprobs_are_checked_and_replace_the_rollouts_where_recorded():
    """Issue 35: a span whose behaviour log-probs were recorded (the engine's sampling mask) is
    truncated but not uncorrected; the list is the behaviour policy's log-probs."""
    spans = [SamplingSpan(start=0, temperature=0.7, top_k=20, behaviour_logprobs=True), SamplingSpan(start=3, temperature=0.7, top_p=0.9)]
    t = make(sampling=spans, behaviour_logprobs=[-0.05, -1.5, 0.0, -0.3])
    assert decode_trajectory(encode_trajectory(t)) == t
    assert t.sampling_truncated and t.truncation_uncorrected  # the top-p span has none
    assert t.behaviour_logprob_list() == [-0.05, -1.5, 0.0, -0.3]
    exact = make(sampling=spans[:1], behaviour_logprobs=[-0.05, -1.5, 0.0, -0.2])
    assert exact.sampling_truncated and not exact.truncation_uncorrected
    assert make().behaviour_logprob_list() == make().rollout_logprobs and not make().truncation_uncorrected
    with pytest.raises(ValueError, match="behaviour_logprobs has 2 entries"):
        make(behaviour_logprobs=[-0.1, -0.2])
    with pytest.raises(ValueError, match="behaviour_logprobs must be finite and <= 0"):
        make(behaviour_logprobs=[-0.1, 0.5, 0.0, -0.3])
    with pytest.raises(ValueError, match="behaviour_logprobs must be finite and <= 0"):
        make(behaviour_logprobs=[float("nan"), -0.5, 0.0, -0.3])


def test_nats_names_derive_from_run_id():
    n = NatsNames("my-run_1")
    assert n.stream == "ASYNCRL_MY_RUN_1"
    assert n.trajectories == "asyncrl.my-run_1.traj"
    assert n.stream_subjects == ["asyncrl.my-run_1.traj", "asyncrl.my-run_1.dlq"]
    assert n.metrics("trainer") == "asyncrl.my-run_1.metrics.trainer"
    assert n.agents_bucket == "ASYNCRL_MY_RUN_1_AGENTS"
    with pytest.raises(ValueError):
        NatsNames("Bad.Run")
    with pytest.raises(ValueError):
        n.environment("a.b")


def test_the_sync_agents_status_and_refusals_are_typed_once():
    """Issue 50 item 1: the trainer reads the agent's ``GET /status`` and its 409 through
    ``AgentStatus`` and ``SyncRefusal`` (asyncrl.wire.sync), not hand-parsed dicts."""
    import json

    from asyncrl.wire.sync import AgentStatus, SyncRefusal

    view = {"id": "e-1", "url": "http://10.0.0.5:30000", "rollout_state": "quarantined", "alive": True, "version": 4,
            "held_because": "serves version 4, current is 5; the next sync brings it"}
    status = AgentStatus.model_validate_json(json.dumps({"version": 5, "accepted_version": 7, "push_wanted": True,
                                                         "engines": [view], "unknown": 1}))
    assert status.newest_version == 7 and status.push_wanted
    assert status.engines[0].version == 4 and status.engines[0].held_because.startswith("serves version 4")
    with pytest.raises(ValueError, match="rollout_state"):  # an engine view is typed too (issue 50 item 5)
        AgentStatus.model_validate({"engines": [{"id": "e-1", "url": "http://x"}]})
    stale = {"error": {"message": "older", "type": "conflict", "reason": "stale", "current_version": 9}}
    refusal = SyncRefusal.parse(409, json.dumps(stale))
    assert refusal is not None and refusal.reason == "stale" and refusal.current_version == 9
    assert SyncRefusal.parse(409, json.dumps({"error": {"reason": "regroup"}})).reason == "regroup"
    assert SyncRefusal.parse(200, json.dumps(stale)) is None
    assert SyncRefusal.parse(409, "not json") is None
    assert SyncRefusal.parse(409, json.dumps({"error": {"reason": "sideways"}})) is None  # not one of REFUSALS


def test_a_tool_call_announcement_is_one_typed_json_object():
    """The core-NATS announcement to an external environment (issue 68 item 4: it was a
    hand-made dict): exactly the documented keys, decoded back whole, a missing key refused."""
    import json

    import msgspec

    from asyncrl.wire.environment import ToolCallAnnouncement

    a = ToolCallAnnouncement(session_id="s-1", token="t", tool_call_id="c-1", name="ask", arguments={"q": 1},
                             deadline=12.5, environment="env-a")
    body = json.loads(a.encode())
    assert body == {"session_id": "s-1", "token": "t", "tool_call_id": "c-1", "name": "ask", "arguments": {"q": 1},
                    "deadline": 12.5, "environment": "env-a"}
    assert ToolCallAnnouncement.decode(a.encode()) == a
    del body["token"]
    with pytest.raises(msgspec.ValidationError, match="token"):
        ToolCallAnnouncement.decode(json.dumps(body).encode())
