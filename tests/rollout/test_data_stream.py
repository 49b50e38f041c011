"""PromptStream: epochs, deterministic shuffling, total_rollout_steps, length filter, and
exact resume from state_dict."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_service.data import PromptRecord, PromptStream


def make_records(n: int, tag: str = "f") -> list[PromptRecord]:
    return [
        PromptRecord(
            prompt_id=f"{tag}{i}",
            messages=({"role": "user", "content": "x" * (i % 7 + 1)},),
            data_source="unit/test",
            ground_truth=str(i),
            source_file=f"{tag}.jsonl",
            source_line=i + 1,
        )
        for i in range(n)
    ]


def ids(stream) -> list[str]:
    return [r.prompt_id for r in stream]


def test_unshuffled_epochs_repeat_file_order() -> None:
    recs = make_records(4)
    out = ids(PromptStream(recs, total_epochs=3, shuffle=False))
    assert out == ["f0", "f1", "f2", "f3"] * 3


def test_shuffle_is_a_permutation_per_epoch_and_matches_the_documented_rule() -> None:
    recs = make_records(20)
    stream = PromptStream(recs, total_epochs=3, seed=7)
    out = ids(stream)
    assert len(out) == len(stream) == 60
    epochs = [out[i * 20:(i + 1) * 20] for i in range(3)]
    for e, chunk in enumerate(epochs):
        assert sorted(chunk) == sorted(r.prompt_id for r in recs)
        order = list(range(20))
        random.Random(7 * 2**32 + e).shuffle(order)  # the rule stated in the module doc
        assert chunk == [f"f{i}" for i in order]
    assert epochs[0] != epochs[1]  # 1/20! chance of equality; fixed seed, so deterministic


def test_same_seed_same_order_other_seed_other_order() -> None:
    recs = make_records(30)
    a = ids(PromptStream(recs, total_epochs=2, seed=1))
    assert a == ids(PromptStream(recs, total_epochs=2, seed=1))
    assert a != ids(PromptStream(recs, total_epochs=2, seed=2))


@pytest.mark.parametrize(("n", "epochs", "steps", "expected"), [
    (5, 3, None, 15),
    (5, 3, 7, 7),  # stops mid-epoch
    (5, 3, 100, 15),  # verl: min(total_rollout_steps, len(data) * epochs)
    (5, 1, 5, 5),
    (1, 4, 3, 3),
])
def test_total_rollout_steps_limits_the_count(n: int, epochs: int, steps: int | None, expected: int) -> None:
    stream = PromptStream(make_records(n), total_epochs=epochs, total_rollout_steps=steps, seed=3)
    assert len(stream) == stream.total == expected
    out = ids(stream)
    assert len(out) == expected
    assert stream.exhausted and stream.remaining == 0 and stream.produced == expected
    with pytest.raises(StopIteration):
        next(stream)


def test_length_filter_skips_and_reports() -> None:
    recs = make_records(10)
    skipped: list[tuple[str, int]] = []
    stream = PromptStream(
        recs, shuffle=False, prompt_length_fn=lambda r: len(r.messages[0]["content"]),
        max_prompt_length=4, on_skip=lambda r, n: skipped.append((r.prompt_id, n)),
    )
    kept = ids(stream)
    expected_kept = [r.prompt_id for r in recs if len(r.messages[0]["content"]) <= 4]
    assert kept == expected_kept
    assert skipped == [(r.prompt_id, len(r.messages[0]["content"])) for r in recs if r.prompt_id not in kept]
    assert stream.skipped_too_long == len(skipped) > 0
    with pytest.raises(ValueError, match="no records"):
        PromptStream(recs, prompt_length_fn=lambda r: 99, max_prompt_length=4, on_skip=lambda r, n: None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 12),
    epochs=st.integers(1, 4),
    steps=st.one_of(st.none(), st.integers(1, 60)),
    seed=st.integers(0, 2**31 - 1),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_resume_continues_exactly(n, epochs, steps, seed, shuffle, data) -> None:
    recs = make_records(n)
    kwargs = dict(total_epochs=epochs, total_rollout_steps=steps, seed=seed, shuffle=shuffle)
    full = ids(PromptStream(recs, **kwargs))
    stops = sorted(data.draw(st.lists(st.integers(0, len(full)), min_size=1, max_size=3)))
    # Run in segments, "restarting" (fresh stream + JSON round-tripped state) at each stop.
    out: list[str] = []
    state = None
    bounds = stops + [len(full)]
    prev = 0
    for stop in bounds:
        if state is None:
            stream = PromptStream(recs, **kwargs)
        else:  # constructed with a wrong seed: the state's seed must win
            stream = PromptStream(recs, **dict(kwargs, seed=seed + 1))
            stream.load_state_dict(json.loads(json.dumps(state)))
        for _ in range(stop - prev):
            out.append(next(stream).prompt_id)
        state = stream.state_dict()
        assert state["produced"] == stop
        prev = stop
    assert out == full
    stream = PromptStream(recs, **kwargs)
    stream.load_state_dict(state)
    assert stream.exhausted and ids(stream) == []


def test_resume_can_extend_the_run() -> None:
    recs = make_records(6)
    first = PromptStream(recs, total_epochs=1, seed=4)
    head = ids(first)
    longer = PromptStream(recs, total_epochs=3, seed=4)
    longer.load_state_dict(first.state_dict())
    tail = ids(longer)
    assert head + tail == ids(PromptStream(recs, total_epochs=3, seed=4))


def test_state_over_other_records_is_refused() -> None:
    stream = PromptStream(make_records(6), seed=1)
    next(stream)
    state = stream.state_dict()
    other = PromptStream(make_records(6, tag="g"), seed=1)
    with pytest.raises(ValueError, match="other records"):
        other.load_state_dict(state)
    shorter = PromptStream(make_records(5), seed=1)
    with pytest.raises(ValueError, match="other records"):
        shorter.load_state_dict(state)
    other.load_state_dict(state, strict=False)  # explicit override
    assert other.produced == 1
    with pytest.raises(ValueError, match="version"):
        other.load_state_dict(dict(state, version=99))
    with pytest.raises(ValueError, match="invalid"):
        PromptStream(make_records(6), seed=1).load_state_dict(dict(state, position=7))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        PromptStream(make_records(3), total_epochs=0)
    with pytest.raises(ValueError):
        PromptStream(make_records(3), total_rollout_steps=0)
    with pytest.raises(ValueError, match="no records"):
        PromptStream([])
