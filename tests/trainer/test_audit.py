"""``asyncrl audit``: the stream reconciled with the trainer's ledger (trainer_daemon.audit)."""

from __future__ import annotations

from trainer_daemon.audit import reconcile
from trainer_daemon.state.ledger import Ledger

DLQ = "asyncrl.t.dlq"
TRAJ = "asyncrl.t.traj"


def lineage() -> list[dict]:
    led = Ledger()
    led.note("poison", 3)
    led.note("dlq", 4)
    led.note("dropped", "b-0", 5)
    led.commit(1, 0, ["a-0", "a-1"], [1, 2])
    led.note("duplicate", "a-0", 6)
    led.commit(2, 1, ["c-0"], [7])
    return led.snapshot(2, 1)["entries"]


def test_every_sequence_is_accounted_for_or_reported():
    entries = lineage()
    # 1-7 accounted for and purged; 8 still stored, not yet trained; 9 purged without record
    out = reconcile(entries, {8: TRAJ}, last_seq=9, dlq_subject=DLQ)
    assert (out.trained, out.dropped, out.duplicate, out.poison, out.dlq) == (3, 1, 1, 1, 1)
    assert (out.pending, out.lost, out.published) == (1, 1, 8) and out.lost_seqs == [9]
    assert not out.ok
    fine = reconcile(entries, {8: TRAJ, 9: DLQ}, last_seq=9, dlq_subject=DLQ)
    assert fine.ok and fine.dlq == 2 and fine.pending == 1


def test_a_trajectory_trained_twice_is_a_violation():
    entries = lineage()
    entries.append({"step": 3, "version": 2, "trained": ["a-1"], "seqs": {"trained": [10]}})
    out = reconcile(entries, {8: TRAJ}, last_seq=10, dlq_subject=DLQ)
    assert out.twice == 1 and out.twice_ids == ["a-1"] and not out.ok


def test_a_finished_run_with_trajectories_left_before_its_end_is_a_violation():
    """Issue 47: a run that ended (the trainer recorded it) still holding trajectories published
    before the rollout's end of data, neither trained nor dropped: named by id, a violation.
    The same stream mid-run (not finished) is only pending."""
    entries = lineage()
    entries.append({"step": 3, "version": 2, "end": [11]})
    stream = {8: TRAJ, 9: DLQ, 10: TRAJ, 11: TRAJ, 12: TRAJ}
    ids = {8: "d-0", 10: "d-1", 11: "<end of data>", 12: "late-0"}
    running = reconcile(entries, stream, last_seq=12, dlq_subject=DLQ, stream_ids=ids)
    assert running.ok and running.pending == 3 and running.unconsumed_at_end == 0
    ended = reconcile(entries, stream, last_seq=12, dlq_subject=DLQ, finished="data_ended", stream_ids=ids)
    assert not ended.ok and ended.unconsumed_at_end == 2 and ended.unconsumed_ids == ["d-0", "d-1"]
    # a run that stopped at its total steps before reading the marker: the marker is no trajectory
    entries.pop()
    at_total = reconcile(entries, {8: TRAJ, 9: DLQ, 11: TRAJ}, last_seq=11, dlq_subject=DLQ, finished="total_steps",
                         stream_ids={8: "d-0", 11: "<end of data>"})
    assert at_total.unconsumed_ids == ["d-0"] and at_total.unconsumed_at_end == 1
    assert at_total.end == 1 and at_total.pending == 1 and at_total.published == 8  # the stored marker is no trajectory


def test_steps_committed_after_the_checkpoint_are_accounted_for_by_the_journal():
    """Issue 64 (found by running the README's `asyncrl audit runs/demo` on a live demo run): with
    ``save_freq = 0`` the stream is purged at each commit and no checkpoint exists until the run
    stops; the purged sequences are in the ledger's journal, not lost. A purged sequence in
    neither is still lost."""
    led = Ledger()
    led.commit(1, 0, ["a-0", "a-1"], [1, 2])
    led.note("dropped", "b-0", 3)
    led.commit(2, 1, ["c-0"], [4])
    journal = led.snapshot(2, None)["entries"]
    out = reconcile([], {6: TRAJ}, last_seq=6, dlq_subject=DLQ, journal=journal)
    assert (out.since_checkpoint, out.trained, out.pending, out.lost, out.lost_seqs) == (4, 0, 1, 1, [5])
    assert not out.ok
    live = reconcile([], {5: TRAJ, 6: TRAJ}, last_seq=6, dlq_subject=DLQ, journal=journal)
    assert live.ok and live.since_checkpoint == 4 and live.pending == 2 and live.published == 6
