"""The sync agent's durable state (sync_agent/records.py): a record keeps the request's typed
parts and round-trips through the state file unchanged; a file written by the agent before
the records were typed (the same JSON) loads into the same models."""

from __future__ import annotations

import json

import pytest

from asyncrl.wire.sync import BucketSpec, ReloadSpec
from sync_agent.records import AgentState, GroupInfo, PlannedGroup, StateFile, SyncRecord


def record() -> SyncRecord:
    group = PlannedGroup(master_address="10.0.0.5", master_port=29555, backend="nccl", group_name="asyncrl-w-1a2b",
                         new=True, world_size=3, members={"e-a": 1, "e-b": 2},
                         urls={"e-a": "http://10.0.0.6:30000", "e-b": "http://10.0.0.7:30000"})
    buckets = [BucketSpec(names=["w", "b"], dtypes=["bfloat16", "float32"], shapes=[[4, 8], [8]])]
    rec = SyncRecord(version=7, group=group, buckets=buckets, reload=ReloadSpec(path="/ckpt/hf-6", version=6), join_group=True)
    rec.enter("pausing")
    rec.engines = {"e-a": "loaded", "e-b": "mixed"}
    return rec


def test_a_record_round_trips_through_the_state_file(tmp_path):
    rec = record()
    state = AgentState(version=6, group=GroupInfo("10.0.0.5", 29555, "nccl", "asyncrl-w-1a2b", 3, {"e-a": 1, "e-b": 2}),
                       records=[rec], needs_reload={"e-b"})
    file = StateFile(tmp_path / "sync" / "state.json")
    file.save(state)
    loaded = file.load()
    assert loaded.records == [rec] and loaded.group == state.group and loaded.needs_reload == {"e-b"}
    back = loaded.records[0]
    assert isinstance(back.group, PlannedGroup) and isinstance(back.buckets[0], BucketSpec) and back.reload.version == 6
    assert back.public()["buckets"] == 1 and back.public()["state"] == "pausing"


def test_a_state_file_of_the_untyped_records_loads(tmp_path):
    rec = record()
    old = {"version": 6, "group": None, "needs_reload": [], "records": [{  # as asdict() wrote it, plus a field since dropped
        **{k: v for k, v in rec.to_json().items()}, "retired_field": 1}]}
    path = tmp_path / "state.json"
    path.write_text(json.dumps(old))
    assert StateFile(path).load().records == [rec]


def test_an_adapter_syncs_record_is_typed_and_survives_the_state_file():
    """Issue 50 item 6: the adapter an adapter sync loads is an AdapterRef (name, path, bytes;
    never the tensors), written to the state file and read back as one."""
    import json

    from pydantic import ValidationError

    from sync_agent.records import AdapterRef, SyncRecord

    rec = SyncRecord(version=3, group=None, buckets=[], adapter=AdapterRef(name="run-v3", path="/shared/run-v3", nbytes=4096),
                     urls={"e0": "http://127.0.0.1:1"})
    back = SyncRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert back.adapter == rec.adapter and isinstance(back.adapter, AdapterRef) and back.urls == rec.urls
    assert "tensors" not in json.dumps(rec.to_json())
    with pytest.raises(ValidationError):
        AdapterRef(name="../escape", nbytes=1)


def test_an_adapters_name_and_its_version_are_made_and_read_in_one_place():
    """Issue 50 item 6: ``adapter_name`` and its inverse live together in asyncrl/wire/sync.py."""
    from asyncrl.sync_control.adapter_load import run_adapters
    from asyncrl.wire.sync import adapter_name, adapter_version

    for version in (1, 7, 12345):
        assert adapter_version("run-a", adapter_name("run-a", version)) == version
    for other in ("run-b-v3", "run-a-v", "run-a-vx", "run-a-v٣", "run-a-v3.0", "run-a"):
        assert adapter_version("run-a", other) is None, other
    assert run_adapters(["run-a-v2", "run-b-v2", "run-a-v10", "base"], "run-a") == {"run-a-v2": 2, "run-a-v10": 10}
