"""Identifiers that reach the file system cannot name a path outside their directory (issue 30
item 1: a session's ``group_id`` of ``..`` made ``/finish`` run ``rmtree(held/..)``, deleting
the whole outbox). The API refuses dot-only and path-like group ids; below it the outbox names a
held group by a hash of its id and refuses a trajectory id that is not a plain file name,
before writing anything, so nothing already accepted is lost."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from asyncrl.files import child_path, hashed_name
from asyncrl.wire import Trajectory
from rollout_service.publish.outbox import Outbox
from tests.rollout.conftest import running_service, service_config

HOSTILE_GROUP_IDS = ["..", ".", "../..", "../x", "a/b", "/etc", "a/../../b", "x\x00y", ".hidden", "..\\..", " ", ""]
API = "data-plane-token-0123456789"


def traj(tid: str, group: str, size: int = 1, index: int = 0) -> Trajectory:
    return Trajectory(id=tid, run_id="demo", group_id=group, group_size=size, group_index=index, prompt_id="p",
                      data_source="d", token_ids=[1, 2, 3], prompt_length=2, loss_mask=[1], rollout_logprobs=[-0.5],
                      weight_versions=[0])


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _seeded(tmp_path: Path) -> tuple[Outbox, set[str]]:
    """An outbox holding one entry in each of ready/, held/, acked/ and rejected/, and a file
    beside it that must survive too."""
    (tmp_path / "beside.txt").write_text("keep me")
    outbox = Outbox(tmp_path / "run" / "outbox", max_items=100, keep_acked_s=3600)
    outbox.put_ready(traj("r-1", "g-ready"))
    outbox.put_ready(traj("a-1", "g-acked"))
    outbox.ack(outbox.ready_entries()[-1], seq=7)
    outbox.put_ready(traj("x-1", "g-rejected"))
    outbox.reject(outbox.ready_entries()[-1], "too large")
    outbox.hold(traj("h-1", "g-held", size=2))
    return outbox, tree(tmp_path)


@pytest.mark.parametrize("group_id", [g for g in HOSTILE_GROUP_IDS if g])
def test_a_hostile_group_id_is_held_and_released_inside_the_outbox(tmp_path: Path, group_id: str):
    outbox, before = _seeded(tmp_path)
    outbox.hold(traj("m-0", group_id, size=2, index=0))
    outbox.hold(traj("m-1", group_id, size=2, index=1))
    assert outbox.held_ids()[group_id] == {"m-0", "m-1"}
    assert outbox.release_group(group_id) == 2
    after = tree(tmp_path)
    assert before <= after, f"lost: {before - after}"  # nothing accepted before is gone
    assert {e.trajectory_id for e in outbox.ready_entries()} == {"r-1", "m-0", "m-1"}
    assert outbox.held_ids() == {"g-held": {"h-1"}} and outbox.rejected_count() == 1 and len(outbox) == 4
    assert all(p.startswith("run/outbox") for p in after - before), sorted(after - before)
    reopened = Outbox(tmp_path / "run" / "outbox", max_items=100)  # and a restart sees the same
    assert len(reopened) == 4 and reopened.held_ids() == {"g-held": {"h-1"}}


async def test_a_hostile_group_id_is_released_inside_the_outbox_by_the_async_writers(tmp_path: Path):
    outbox, before = _seeded(tmp_path)
    await outbox.hold_async(traj("m-0", "..", size=1))
    assert await outbox.release_group_async("..") == 1
    assert before <= tree(tmp_path) and {e.trajectory_id for e in outbox.ready_entries()} == {"r-1", "m-0"}


@pytest.mark.parametrize("tid", ["../evil", "a/b", "..", ".", "/abs", ".hidden", "x" * 300])
def test_a_trajectory_id_that_is_not_a_plain_name_is_refused_before_anything_is_written(tmp_path: Path, tid: str):
    outbox, before = _seeded(tmp_path)
    with pytest.raises(ValueError):
        outbox.put_ready(traj(tid, "g"))
    with pytest.raises(ValueError):
        outbox.hold(traj(tid, "g", size=2))
    assert tree(tmp_path) == before, tree(tmp_path) ^ before
    assert len(outbox) == 2


def test_held_groups_of_an_earlier_version_named_by_their_raw_id_are_renamed_at_start(tmp_path: Path):
    root = tmp_path / "outbox"
    Outbox(root, max_items=10)
    legacy = root / "held" / "s00000003"
    legacy.mkdir()
    from asyncrl.wire import encode_trajectory

    (legacy / "t-1.traj").write_bytes(encode_trajectory(traj("t-1", "s00000003", size=2)))
    outbox = Outbox(root, max_items=10)
    assert outbox.held_ids() == {"s00000003": {"t-1"}} and len(outbox) == 1 and not legacy.exists()
    outbox.hold(traj("t-2", "s00000003", size=2, index=1))
    assert outbox.release_group("s00000003") == 2 and [e.trajectory_id for e in outbox.ready_entries()] == ["t-1", "t-2"]


def test_child_path_keeps_every_name_inside_its_directory(tmp_path: Path):
    for name in ["..", ".", "a/b", "../x", "", ".hidden", "/abs", "x\x00"]:
        with pytest.raises(ValueError):
            child_path(tmp_path, name)
    assert child_path(tmp_path, "000000000001-run-s00000001-0.traj").parent == tmp_path.resolve()
    assert hashed_name("..", "g-") != hashed_name(".", "g-") and child_path(tmp_path, hashed_name("..", "g-"))


async def test_the_session_api_refuses_dot_only_and_path_like_group_ids(tmp_path, nats_server, warm_engine):
    cfg = service_config(tmp_path, nats_server.url, [warm_engine], "rollout.total_rollout_steps=1", "rollout.publish_unit=group",
                         "async_training.staleness_threshold=50", f"security.api_token={API}")
    async with running_service(cfg) as (svc, url), httpx.AsyncClient(timeout=60) as http:
        api = {"Authorization": f"Bearer {API}"}
        for group_id in HOSTILE_GROUP_IDS:
            r = await http.post(f"{url}/v1/sessions", json={"group_id": group_id}, headers=api)
            assert r.status_code == 400 and "group_id" in r.json()["error"]["message"], (group_id, r.status_code, r.text)
        # a group id with dots inside is fine, and its session goes through to the outbox and out
        s = (await http.post(f"{url}/v1/sessions", json={"group_id": "team.a:1"}, headers=api)).json()
        auth = {"Authorization": f"Bearer {s['token']}"}
        r = await http.post(f"{s['base_url']}/chat/completions", headers=auth,
                            json={"messages": [{"role": "user", "content": "1 + 1"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert (await http.post(f"{url}/v1/sessions/{s['id']}/reward", json={"reward": 1.0}, headers=auth)).status_code == 200
        done = await http.post(f"{url}/v1/sessions/{s['id']}/finish", headers=auth)
        assert done.status_code == 200, done.text
        outbox = svc.runner.outbox
        for d in (outbox.ready_dir, outbox.held_dir, outbox.rejected_dir, outbox.acked_dir):
            assert d.is_dir()
