"""asyncrl.files: the one atomic, durable file write (tmp file, fsync, rename, directory fsync)."""

from __future__ import annotations

import pytest

from asyncrl.files import atomic_file, atomic_write


def test_atomic_write_replaces_bytes_and_text_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    atomic_write(path, b"\x00old")
    atomic_write(path, "new ✓")
    assert path.read_text(encoding="utf-8") == "new ✓"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_failed_streaming_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"whole")
    with pytest.raises(RuntimeError), atomic_file(path) as f:
        f.write(b"half")
        raise RuntimeError("download broke")
    assert path.read_bytes() == b"whole" and [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_the_temporary_is_a_hidden_tmp_file_beside_the_target(tmp_path):
    """Directory scanners (the rollout outbox) recognise a crash's leftover by ``*.tmp``."""
    path = tmp_path / "000000000001-x.traj"
    with atomic_file(path) as f:
        (leftover,) = tmp_path.glob("*.tmp")
        assert leftover.name.startswith(".000000000001-x.traj.") and leftover.parent == tmp_path
        f.write(b"ok")
    assert path.read_bytes() == b"ok"
