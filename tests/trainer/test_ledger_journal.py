"""The ledger's journal of committed steps (trainer_daemon/state/ledger.py, "Lost steps"): steps
trained after the last complete checkpoint are found after a crash, recorded once in the next
segment (also across a second crash before that checkpoint), and the journal stays bounded."""

from __future__ import annotations

import json

from trainer_daemon.state.ledger import JOURNAL, LEDGER_DIR, Ledger, lost_steps


def ledger(root, parent):
    return Ledger(parent=parent, journal=root / LEDGER_DIR / JOURNAL)


def test_lost_steps_are_found_recorded_once_and_trimmed(tmp_path):
    a = ledger(tmp_path, None)
    for step in (1, 2, 3, 4):
        a.commit(step, step, [f"t{step}a", f"t{step}b"], [10 * step, 10 * step + 1], [(step - 1, step - 1)] * 2)
        if step == 2:  # checkpoint 2 complete
            a.snapshot(2, 2)
            a.trim_journal(2)
    assert [e["step"] for e in lost_steps(tmp_path, 2)] == [3, 4]  # crash after step 4

    b = ledger(tmp_path, 2)  # restart from checkpoint 2
    b.adopt_lost(lost_steps(tmp_path, 2))
    b.commit(3, 5, ["t3a", "t3b"], [30, 31])
    # a second crash before the next checkpoint: the first crash's steps are still found, once, with the new step 3
    found = lost_steps(tmp_path, 2)
    assert sorted((e["step"], tuple(e["trained"])) for e in found) == [(3, ("t3a", "t3b")), (3, ("t3a", "t3b")), (4, ("t4a", "t4b"))]

    c = ledger(tmp_path, 2)
    c.adopt_lost(lost_steps(tmp_path, 2))
    c.commit(3, 7, ["t3a", "t3b"], [30, 31])
    seg = c.snapshot(3, 7)
    c.trim_journal(3)
    record = seg["entries"][0]
    assert record["between_steps"] and record["trained"] == [] and len(record["lost_steps"]) == 3
    assert record["lost_steps"][0]["seqs"]["trained"] == [30, 31]
    assert seg["entries"][1]["trained"] == ["t3a", "t3b"]
    assert lost_steps(tmp_path, 3) == [] and (tmp_path / LEDGER_DIR / JOURNAL).read_text() == ""


def test_entries_carry_the_versions_that_generated_each_trajectory(tmp_path):
    a = ledger(tmp_path, None)
    a.commit(1, 4, ["x", "y"], [1, 2], [(2, 3), (4, 4)])
    line = json.loads((tmp_path / LEDGER_DIR / JOURNAL).read_text())
    assert line["generated_by"] == [[2, 3], [4, 4]] and a.snapshot(1, 4)["entries"][0]["generated_by"] == [[2, 3], [4, 4]]


def test_a_line_cut_by_a_crash_is_ignored(tmp_path):
    a = ledger(tmp_path, None)
    a.commit(1, 1, ["x"], [1])
    with (tmp_path / LEDGER_DIR / JOURNAL).open("a") as f:
        f.write('{"step": 2, "trai')
    assert [e["step"] for e in lost_steps(tmp_path, 0)] == [1]


def test_a_second_checkpoint_of_the_same_step_extends_its_segment_on_the_same_lineage(tmp_path):
    """Issue 65: groups dropped after the last step's checkpoint (the run's end) are recorded by
    checkpointing that step again: its segment is the first one's entries and the new ones, with
    the first one's parent (never itself: the lineage stays a chain), also by a trainer that
    restored that step (the segment read back from disk)."""
    from trainer_daemon.state.ledger import ledger_accounts, read_lineage, write_segment

    a = Ledger(parent=None, root=tmp_path)
    a.commit(1, 1, ["t1"], [1])
    write_segment(tmp_path, a.snapshot(1, 1))
    a.commit(2, 2, ["t2"], [2])
    write_segment(tmp_path, a.snapshot(2, 2))
    assert not a.unsaved
    a.note("dropped", "t3", 3)
    assert a.unsaved
    again = a.snapshot(2, 2)
    assert again["parent"] == 1 and [e.get("trained") for e in again["entries"]] == [["t2"], []]
    write_segment(tmp_path, again)
    kinds, _ = ledger_accounts(read_lineage(tmp_path, 2))
    assert kinds == {1: "trained", 2: "trained", 3: "dropped"}

    b = Ledger(parent=2, root=tmp_path)  # a trainer restored from step 2
    b.note("dropped", "t4", 4)
    write_segment(tmp_path, b.snapshot(2, 2))
    kinds, _ = ledger_accounts(read_lineage(tmp_path, 2))
    assert kinds == {1: "trained", 2: "trained", 3: "dropped", 4: "dropped"}
