"""``asyncrl audit``: the stream reconciled with the trainer's ledger (trainer_daemon.audit)."""

from __future__ import annotations

from trainer_daemon.audit import reconcile
from trainer_daemon.ledger import Ledger

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
