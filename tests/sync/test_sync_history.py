"""The sync agent's history on disk (sync_agent/history.py): bounded by rotation, newest kept."""

from __future__ import annotations

from sync_agent.history import FILE, SyncHistory

MAX = 4096


def test_history_rotates_within_twice_its_bound_and_keeps_the_newest(tmp_path):
    h = SyncHistory(tmp_path, MAX)
    for i in range(500):
        h.append("refused" if i % 3 else "finished", version=i, message="x" * 40)
    current, previous = tmp_path / FILE, tmp_path / (FILE + ".1")
    assert current.stat().st_size <= MAX and previous.stat().st_size <= MAX
    events = h.read()
    assert [e["version"] for e in events] == list(range(500 - len(events), 500)), "oldest first, nothing skipped"
    line = len(current.read_text().splitlines()[0]) + 1
    assert len(events) * line >= MAX, "at least the bound's worth of events is kept"
    assert {e["event"] for e in events} == {"finished", "refused"} and all("time" in e for e in events)


def test_an_unwritable_history_never_raises(tmp_path):
    (tmp_path / "sync").write_text("a file where the directory should be")
    h = SyncHistory(tmp_path / "sync", MAX)
    h.append("finished", version=1)  # logged and dropped
    assert h.read() == []
