"""Durable state that does not grow with the run's length (issue: bounded state), on a real
nats-server:

- the agents KV bucket: a finished trajectory's key is purged, not deleted, and the purge
  marker expires, so the bucket's stream holds the live agents only (a plain KV delete leaves
  one marker per key for ever: measured here too, so the test shows why);
- sessions: a closed session is forgotten after ``api.closed_session_retention_s`` (memory and
  bucket); open and recently closed ones stay;
- dead letters: each checkpoint's purge keeps the newest ``nats.dead_letters_keep``.
"""

from __future__ import annotations

from asyncrl.jetstream import (
    StreamSettings,
    connect,
    ensure_kv,
    ensure_stream,
    kv_entries,
    kv_forget,
)
from asyncrl.jetstream.setup import FORGET_MARKER_TTL_S
from asyncrl.wire import NatsNames
from rollout_service.agent.state import AgentState, Phase
from rollout_service.openai.sessions import SessionManager, SessionRecord
from rollout_service.runner.store import AgentStore, kv_key
from tests.helpers.waiting import wait_for
from trainer_daemon.consume.source import TrajectorySource
from trainer_daemon.consume.state import ConsumptionState
from trainer_daemon.state.ledger import Ledger

N = 20
MARKER_WAIT_S = FORGET_MARKER_TTL_S + 25.0  # the markers' TTL, and the server's expiry scan on a busy box


async def messages_are(js, stream: str, n: int) -> bool:
    return await messages(js, stream) == n


def agent(i: int) -> AgentState:
    return AgentState(id=f"run.g{i}.0", run_id="run", group_id=f"g{i}", group_size=1, group_index=0, prompt_id="p",
                      data_source="d", phase=Phase.GENERATING, token_ids=[1, 2, 3], prompt_length=2, loss_mask=[1],
                      logprobs=[-0.1], versions=[0])


async def messages(js, stream: str, subject: str | None = None) -> int:
    """Messages in ``stream`` (on ``subject`` only, when given)."""
    if subject is None:
        return int((await js.stream_info(stream)).state.messages)
    info = await js.stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


async def test_finished_agents_leave_nothing_in_the_bucket(nats_server):
    nc = await connect(nats_server.url, "test", persistent=False)
    try:
        js = nc.jetstream()
        plain = await ensure_kv(js, "plain-delete")
        for i in range(N):
            await plain.put(f"k{i}", b"state")
            await plain.delete(f"k{i}")
        assert await messages(js, "KV_plain-delete") == N, "a KV delete leaves a marker per key"

        bucket = "agents-test"
        store = AgentStore(await ensure_kv(js, bucket), js, bucket)
        for i in range(N):
            assert await store.put(agent(i))
        assert await messages(js, f"KV_{bucket}") == N
        for i in range(N - 2):
            assert await store.delete(agent(i).id)
        assert sorted(await store.kv.keys()) == sorted(kv_key(agent(i).id) for i in (N - 2, N - 1))
        # the purge markers expire (FORGET_MARKER_TTL_S): finished agents leave nothing behind
        await wait_for(lambda: messages_are(js, f"KV_{bucket}", 2), MARKER_WAIT_S, "the purge markers to expire")
        assert sorted(s.id for s in await store.load_all()) == sorted(agent(i).id for i in (N - 2, N - 1))
        assert store.pending == 0
    finally:
        await nc.close()


async def test_closed_sessions_are_forgotten_after_the_retention(nats_server):
    nc = await connect(nats_server.url, "test", persistent=False)
    try:
        js = nc.jetstream()
        bucket = "sessions-test"
        kv = await ensure_kv(js, bucket)
        mgr = SessionManager(kv, ttl_s=100.0, max_open=10, retention_s=60.0, forget=lambda key: kv_forget(js, bucket, key))
        now = 10_000.0
        specs = {"open-old": ("open", now - 90), "finished-old": ("finished", now - 61), "expired-old": ("expired", now - 500),
                 "finished-recent": ("finished", now - 30)}
        for sid, (status, at) in specs.items():
            rec = SessionRecord(id=sid, token_hash="h", agent=agent(0), created_at=at, last_activity=at, status=status,
                                finished_at=at if status == "finished" else None)
            mgr.add(rec)
            await mgr.save(rec)
        gone = await mgr.forget_closed(now)
        assert sorted(gone) == ["expired-old", "finished-old"]
        assert sorted(mgr.sessions) == ["finished-recent", "open-old"]
        await wait_for(lambda: messages_are(js, f"KV_{bucket}", 2), MARKER_WAIT_S, "the purge markers to expire")
        assert mgr.forgotten_total == 2
        again = SessionManager(kv, ttl_s=100.0, max_open=10, entries=lambda: kv_entries(js, bucket))
        assert await again.restore() == 2  # a restarted service does not bring them back
    finally:
        await nc.close()


async def test_dead_letters_keep_the_newest(nats_server, run_config):
    nc = await connect(nats_server.url, "test", persistent=False)
    try:
        js = nc.jetstream()
        await ensure_stream(js, StreamSettings.of(run_config))
        names = NatsNames(run_config.run.id)
        for i in range(5):
            await js.publish(names.dead_letters, f"dead {i}".encode())
        seqs = [(await js.publish(names.trajectories, b"t")).seq for _ in range(3)]
        source = TrajectorySource(names, ConsumptionState(), Ledger(parent=None), 2, dead_letters_keep=2)
        source._js = js  # the consumer itself is not needed for a purge
        await source.purge_through(seqs[1])
        assert await messages(js, names.stream, names.dead_letters) == 2
        assert await messages(js, names.stream, names.trajectories) == 1
        kept = await js.get_last_msg(names.stream, names.dead_letters)
        assert kept.data == b"dead 4"
    finally:
        await nc.close()
