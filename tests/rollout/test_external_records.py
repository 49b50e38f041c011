"""External call records in isolation (the broker with an in-memory record store; the NATS
bucket itself is exercised by tests/rollout/test_external_env.py): answers hold until the
retention ends, then the call is unknown; a restored broker answers as the old one did."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config.sections_core import ExternalToolConfig
from asyncrl.http.errors import ApiError
from rollout_service.agent.external_tools import ExternalBroker

WAIT_S = 10.0


class MemoryRecords:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    async def put(self, key: str, value: bytes) -> None:
        self.data[key] = value

    async def forget(self, key: str) -> None:
        self.data.pop(key, None)

    async def load_all(self) -> list[bytes]:
        return list(self.data.values())


async def _no_announce(env: str, payload: bytes) -> None:
    return None


def broker(store, retention_s=60.0, deadline_s=30.0) -> ExternalBroker:
    tool = ExternalToolConfig(name="kb", environment="kb", deadline_s=deadline_s)
    return ExternalBroker({"kb": tool}, _no_announce, store, retention_s=retention_s)


async def _park_and_answer(b: ExternalBroker, content: str, is_error: bool) -> tuple[str, bool]:
    task = asyncio.create_task(b.call("s1", "c1", "kb", {}, None))
    (call,) = await asyncio.wait_for(b.pending(session_id="s1", wait_s=WAIT_S), WAIT_S)
    assert (await b.post_result("s1", "c1", content, is_error, call["token"]))["duplicate"] is False
    return await asyncio.wait_for(task, WAIT_S), call["token"]


async def test_answers_hold_until_the_retention_ends_then_the_call_is_unknown():
    store = MemoryRecords()
    b = broker(store, retention_s=0.2)
    result, token = await _park_and_answer(b, "no such page", True)
    assert result == ("no such page", True), "is_error reaches the agent"
    b.forget("s1")  # the agent finished
    assert (await b.post_result("s1", "c1", "no such page", True, token))["duplicate"] is True
    with pytest.raises(ApiError) as conflict:
        await b.post_result("s1", "c1", "no such page", False, token)  # is_error differs: a different result
    assert conflict.value.status == 409
    with pytest.raises(ApiError) as forbidden:
        await b.post_result("s1", "c1", "no such page", True, "sess-wrong")
    assert forbidden.value.status == 403
    rec = b.records[("s1", "c1")]
    assert await b.sweep() == 0 and store.data, "kept within the retention"
    assert await b.sweep(now=rec.deadline + 0.1) == 0, "kept until the deadline plus the retention"
    assert await b.sweep(now=rec.deadline + 0.3) == 1 and not store.data
    with pytest.raises(ApiError) as gone:
        await b.post_result("s1", "c1", "no such page", True, token)
    # forgotten with its session: the token can no longer be checked, so it is not told apart
    # from a wrong one (a prober learns nothing about which sessions exist)
    assert gone.value.status == 403 and "forgotten" in str(gone.value)


async def test_a_restored_broker_answers_as_the_old_one_and_agents_find_their_results():
    store = MemoryRecords()
    old = broker(store)
    _, token = await _park_and_answer(old, "page 3", False)
    new = broker(store)
    assert await new.restore() == 1
    assert (await new.post_result("s1", "c1", "page 3", False, token))["duplicate"] is True
    # the agent restored from a checkpoint taken before the answer parks the call again: answered at once
    assert await asyncio.wait_for(new.call("s1", "c1", "kb", {}, None), WAIT_S) == ("page 3", False)


async def test_an_expired_call_answers_409_after_its_agent_moved_on():
    b = broker(MemoryRecords(), deadline_s=0.05)
    task = asyncio.create_task(b.call("s1", "c1", "kb", {}, None))
    (call,) = await asyncio.wait_for(b.pending(session_id="s1", wait_s=WAIT_S), WAIT_S)
    content, is_error = await asyncio.wait_for(task, WAIT_S)
    assert is_error and "did not answer" in content
    b.forget("s1")
    with pytest.raises(ApiError) as late:
        await b.post_result("s1", "c1", "1", False, call["token"])
    assert late.value.status == 409 and b.records[("s1", "c1")].status == "expired"
