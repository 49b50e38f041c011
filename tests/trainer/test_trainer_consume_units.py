"""Consumption bookkeeping without NATS: cursor, resolved set, id memory, group assembly,
ledger lineage. One property per test."""

from __future__ import annotations

import random

import pytest

from asyncrl.wire import SamplingSpan
from tests.trainer.helpers import make_group
from trainer_daemon.algo import StalenessBound
from trainer_daemon.consume import ConsumptionState, GroupAssembler, Held
from trainer_daemon.consume.exclusion import excluder, exclusion_reason
from trainer_daemon.state.ledger import Ledger, read_lineage, write_segment


def test_cursor_stops_below_the_oldest_held_message():
    s = ConsumptionState()
    for seq in (1, 2, 3, 4):
        s.delivered(seq)
        s.hold(seq)
    s.resolve([(2, "trained", "b"), (4, "trained", "d")])
    assert s.cursor == 0 and s.is_resolved(2) and not s.is_resolved(1)
    s.resolve([(1, "trained", "a")])
    assert s.cursor == 2 and not s.is_resolved(3) and s.is_resolved(4)
    s.resolve([(3, "dropped", "c")])
    assert s.cursor == 4 and s.above == {}


def test_cursor_skips_gaps_of_other_subjects():
    s = ConsumptionState()
    s.delivered(5)  # sequences 1-4 are dead letters: never delivered to the trainer
    s.hold(5)
    s.resolve([(5, "trained", "x")])
    assert s.cursor == 5


def test_state_roundtrip_keeps_resolved_above_cursor_and_ids():
    s = ConsumptionState()
    for seq in (1, 2, 3):
        s.delivered(seq)
        s.hold(seq)
    s.resolve([(3, "trained", "c"), (2, "poison", "")])
    s.count("poison")
    r = ConsumptionState()
    r.load_state_dict(s.state_dict())
    assert r.cursor == 0 and r.is_resolved(2) and r.is_resolved(3) and not r.is_resolved(1)
    assert r.knows_id("c") and r.counters["poison"] == 1 and r.held == set()


def test_duplicate_resolution_does_not_make_the_id_known():
    """The original may still be held at a checkpoint; after a restart it must be trained."""
    s = ConsumptionState()
    s.delivered(1), s.hold(1), s.delivered(2)
    s.resolve([(2, "duplicate", "same")])
    r = ConsumptionState()
    r.load_state_dict(s.state_dict())
    assert not r.knows_id("same") and r.is_resolved(2) and not r.is_resolved(1)


def test_ids_below_cursor_are_remembered_within_the_bound():
    s = ConsumptionState(recent_ids=2)
    for seq, tid in ((1, "a"), (2, "b"), (3, "c")):
        s.delivered(seq)
        s.hold(seq)
        s.resolve([(seq, "trained", tid)])
    assert s.cursor == 3 and s.knows_id("b") and s.knows_id("c") and not s.knows_id("a")


def _held(trajs, start_seq=1):
    return [Held(start_seq + i, t, b"") for i, t in enumerate(trajs)]


def test_groups_wait_until_complete_then_leave_in_completion_order():
    rng = random.Random(0)
    a, b = make_group(rng, "a", 2), make_group(rng, "b", 2)
    asm = GroupAssembler(patience=100)
    items = _held([a[0], b[0], b[1], a[1]])
    for h in items[:3]:
        asm.add(h)
    assert asm.num_ready(3) == 1
    asm.add(items[3])
    taken = asm.take(2, 4, version=0, bound=None)
    assert [[h.traj.id for h in g.kept] for g in taken.groups] == [["b-0", "b-1"], ["a-0", "a-1"]]


def test_incomplete_group_is_released_after_patience():
    rng = random.Random(0)
    a = make_group(rng, "a", 3)
    asm = GroupAssembler(patience=5)
    asm.add(Held(1, a[0], b""))
    assert asm.num_ready(6) == 0 and asm.num_ready(7) == 1
    taken = asm.take(1, 7, version=0, bound=None)
    assert taken.groups[0].incomplete and len(taken.groups[0].kept) == 1


def test_a_groups_size_is_its_first_members_and_a_later_claim_cannot_hold_it_open():
    """Issue 30: a member claiming group_size 1024 used to raise the group's size and stall it."""
    rng = random.Random(0)
    a = make_group(rng, "a", 2)
    asm = GroupAssembler(patience=100)
    asm.add(Held(1, a[0], b""))
    asm.add(Held(2, a[1].__class__(**{**{f: getattr(a[1], f) for f in a[1].__struct_fields__}, "group_size": 1024}), b""))
    assert asm.num_ready(2) == 1
    taken = asm.take(1, 2, version=0, bound=None)
    assert not taken.groups[0].incomplete and [h.traj.id for h in taken.groups[0].kept] == ["a-0", "a-1"]


@pytest.mark.parametrize("seed", range(12))
def test_chunked_and_bulk_reads_take_the_same_groups(seed):
    """Groups and their order depend on the stream alone, not on how it was fetched (exact resume)."""
    rng = random.Random(seed)
    trajs = [t for g in range(6) for t in make_group(rng, f"g{g}", 3)]
    rng.shuffle(trajs)
    trajs = trajs[: len(trajs) - rng.randrange(3)]  # some groups never complete
    items = _held(trajs)

    def order(chunk: int) -> list[list[str]]:
        asm, out = GroupAssembler(patience=4), []
        for i in range(0, len(items), chunk):
            for h in items[i:i + chunk]:
                asm.add(h)
            top = items[min(i + chunk, len(items)) - 1].seq
            while asm.num_ready(top):
                out += [[h.traj.id for h in g.kept] for g in asm.take(1, top, 0, None).groups]
        top = items[-1].seq + 100  # the stream moved on: everything left is released
        while asm.num_ready(top):
            out += [[h.traj.id for h in g.kept] for g in asm.take(1, top, 0, None).groups]
        return out

    bulk = order(len(items))
    assert sorted(i for g in bulk for i in g) == sorted(t.id for t in trajs)
    for chunk in (1, 2, 3, 7):
        assert order(chunk) == bulk


def test_stale_members_are_dropped_at_take_time():
    rng = random.Random(0)
    old = make_group(rng, "old", 2, version=0)
    asm = GroupAssembler(patience=100)
    for h in _held(old):
        asm.add(h)
    taken = asm.take(1, 2, version=2, bound=StalenessBound(1))
    assert taken.groups == [] and [h.traj.id for h in taken.empty[0].dropped] == ["old-0", "old-1"]


def _with(t, **over):
    return t.__class__(**{**{f: getattr(t, f) for f in t.__struct_fields__}, **over})


def test_infrastructure_failures_are_excluded_and_the_group_trains_the_rest():
    group = make_group(random.Random(0), "g", 4)
    group[1] = _with(group[1], failure="reward_error")
    group[2] = _with(group[2], finish_reason="expired")  # a publisher from before the failure field
    group[3] = _with(group[3], finish_reason="length")  # a genuine task outcome: trained
    asm = GroupAssembler(patience=100)
    for h in _held(group):
        asm.add(h)
    taken = asm.take(1, 4, version=0, bound=None, exclude=excluder("train"))
    (pg,) = taken.groups
    assert [h.traj.id for h in pg.kept] == ["g-0", "g-3"]
    assert [(h.traj.id, why) for h, why in pg.excluded] == [("g-1", "reward_error"), ("g-2", "environment_expired")]
    assert [h.traj.id for h in pg.unused] == ["g-1", "g-2"]


def test_a_group_of_failures_only_trains_nothing():
    group = [_with(t, failure="engine_error") for t in make_group(random.Random(1), "f", 2)]
    asm = GroupAssembler(patience=100)
    for h in _held(group):
        asm.add(h)
    taken = asm.take(1, 2, version=0, bound=None, exclude=excluder("train"))
    assert taken.groups == [] and len(taken.empty[0].excluded) == 2


@pytest.mark.parametrize("span,rule,want", [
    (SamplingSpan(start=0, temperature=0.7, top_p=0.9), "train", ""),
    (SamplingSpan(start=0, temperature=0.7, top_p=0.9), "drop", "truncated_sampling"),
    (SamplingSpan(start=0, temperature=0.7, top_k=20), "drop", "truncated_sampling"),
    (SamplingSpan(start=0, temperature=0.7, min_p=0.05), "drop", "truncated_sampling"),
    (SamplingSpan(start=0, temperature=0.0, top_k=1), "drop", ""),  # greedy is not a truncated sample
    (SamplingSpan(start=0, temperature=0.7), "drop", ""),
    # issue 35: the engine reported the truncated distribution's log-probs: exact, never dropped
    (SamplingSpan(start=0, temperature=0.7, top_k=20, behaviour_logprobs=True), "drop", ""),
])
def test_truncated_sampling_rule(span, rule, want):
    t = _with(make_group(random.Random(2), "s", 2)[0], sampling=[span])
    assert exclusion_reason(t, rule) == want


def test_ledger_lineage_ignores_abandoned_segments(tmp_path):
    led = Ledger()
    led.commit(1, 0, ["a"])
    write_segment(tmp_path, led.snapshot(1, 0))
    led.commit(2, 0, ["b"])
    write_segment(tmp_path, led.snapshot(2, 0))  # this timeline crashed before step 2 completed ...
    again = Ledger(parent=1)  # ... and resumed from 1
    again.note("poison", 7)
    again.commit(2, 0, ["b2"])
    write_segment(tmp_path, again.snapshot(2, 0))
    entries = read_lineage(tmp_path, 2)
    assert [e["trained"] for e in entries] == [["a"], ["b2"]] and entries[1]["poison"] == [7]


def test_ledger_rejects_a_parent_cycle(tmp_path):
    write_segment(tmp_path, {"step": 3, "parent": 3, "entries": []})
    with pytest.raises(ValueError):
        read_lineage(tmp_path, 3)
