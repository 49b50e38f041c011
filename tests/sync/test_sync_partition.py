"""F11 (RELIABILITY.md): the trainer and one engine partitioned in the middle of a broadcast.

A real cut: iptables DROP on the loopback ports of every TCP connection between the engine
and the trainer's side of the collective (its gloo pairs and the group's store), nothing on
the engine's HTTP port, so the sync agent and the rollout service still reach it. The trainer
is stopped after a few buckets, the cut is made, the trainer goes on.

Shown: the sync ends within its bounds (no hang: the broadcast times out); no engine that did
not confirm every bucket serves afterwards, and whatever serves holds exactly one set of
weights (the old or the new); the rollout resumes and decodes within a bound; once the
partition heals, the next sync (a new group) brings both engines to the trainer's weights and
the run is healthy.
"""

from __future__ import annotations

import asyncio
import os
import time

import psutil

from asyncrl.models import load_model
from tests.helpers.netfilter import Partition, iptables_or_skip
from tests.helpers.run_health import wait_run_healthy
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import ADMIN
from tests.sync.conftest import SYNC_TOKEN, perturbed_weights, publisher, stack
from tests.sync.test_sync_agent import engine_logprobs, model_logprobs

BROADCAST_TIMEOUT_S = 10.0
CUT_AFTER_BUCKETS = 5
F11_BOUND_S = 300.0  # RELIABILITY.md F11: within T_sync
SYNC_END_S = 90.0  # broadcast timeout + the engines' own collective timeout (15 s) + quarantine, on a busy box


def collective_ports(engine_pid: int, http_port: int) -> list[int]:
    """The engine's local ports of its TCP connections to this process, its HTTP port excepted."""
    mine = {c.laddr.port for c in psutil.Process(os.getpid()).net_connections(kind="tcp")}
    out = []
    for c in psutil.Process(engine_pid).net_connections(kind="tcp"):
        if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.laddr.port != http_port and c.raddr.port in mine:
            out.append(c.laddr.port)
    return out


def gate_after(monkeypatch, k: int) -> tuple[list[int], asyncio.Event, asyncio.Event]:
    """The trainer's side stops before bucket ``k`` until ``go`` is set; ``reached`` is set
    when it stops there. Returns (buckets sent, reached, go)."""
    import trainer_daemon.sync.agent as trainer_side

    real = trainer_side.send_buckets
    sent, reached, go = [0], asyncio.Event(), asyncio.Event()

    async def gated(buckets, weights, buffers, send):
        async def gated_send(i, bucket, flat):
            if i == k:
                reached.set()
                await go.wait()
            await send(i, bucket, flat)
            sent[0] += 1
        return await real(buckets, weights, buffers, gated_send)

    monkeypatch.setattr(trainer_side, "send_buckets", gated)
    return sent, reached, go


async def test_trainer_engine_partition_mid_broadcast_is_bounded_and_serves_no_mixed_weights(tmp_path, nats_server, engines,
                                                                                             monkeypatch):
    iptables = iptables_or_skip()
    sent, reached, go = gate_after(monkeypatch, CUT_AFTER_BUCKETS)
    urls = [e.url for e in engines]
    reload_dir = tmp_path / "initial-weights"
    original = load_model("builtin:tiny")
    original.save_pretrained(reload_dir, safe_serialization=True)
    extra = [f"sync.broadcast_timeout_s={BROADCAST_TIMEOUT_S}", f"sync.reload_path={reload_dir}"]
    async with stack(tmp_path, nats_server.url, urls, *extra) as (svc, rollout_url, agent, agent_url, cfg):
        pub = publisher(agent_url, cfg, bucket_bytes=8 * 1024)
        partition = None
        try:
            model1, weights1 = perturbed_weights(1)
            publish = asyncio.create_task(pub.publish(1, weights1))
            await wait_for(reached.wait, 60, f"{CUT_AFTER_BUCKETS} buckets broadcast")
            ports = collective_ports(engines[0].proc.pid, engines[0].port)
            assert ports, "no collective connection between the engine and the trainer's side"
            partition = Partition(iptables, ports)
            partition.cut()
            cut_at = time.monotonic()
            go.set()
            try:
                await asyncio.wait_for(publish, SYNC_END_S)
                trainer_ok = True
            except TimeoutError:
                raise AssertionError(f"the trainer's broadcast still hangs {SYNC_END_S:.0f} s after the cut") from None
            except Exception:  # noqa: BLE001 - the trainer's side of a cut broadcast fails
                trainer_ok = False
            rec = agent.coordinator.records[-1]
            await wait_for(lambda: rec.done, SYNC_END_S, "the sync to end")
            assert rec.state == "failed" and not trainer_ok, (rec.state, rec.error)
            assert not svc.runner.paused, "the rollout was left paused"
            # nothing that missed a bucket serves; whatever serves holds one set of weights
            await wait_for(lambda: any(e["state"] == "healthy" for e in svc.pool.snapshot()), 120,
                           "an engine serving again (reloaded)")
            for e in svc.pool.snapshot():
                if e["state"] == "healthy":
                    ids, lps, wv = await engine_logprobs(e["url"])
                    ref = original if wv == 0 else model1
                    assert wv in (0, 1) and max(abs(a - b) for a, b in zip(lps, model_logprobs(ref, ids))) < 1e-4, \
                        f"{e['url']} serves weights that are not version {wv}'s"
            before = sum(e["tokens_decoded"] for e in svc.pool.snapshot())
            await wait_for(lambda: sum(e["tokens_decoded"] for e in svc.pool.snapshot()) > before + 50, 60,
                           "the rollout decoding during the partition")

            partition.heal()
            model2, weights2 = perturbed_weights(2)
            for _attempt in range(3):  # the first may only tell the trainer to form a new group
                try:
                    await pub.publish(2, weights2)
                except Exception:  # noqa: BLE001
                    pass
                await wait_for(lambda: agent.coordinator.records[-1].done, 60, "sync 2")
                if agent.coordinator.records[-1].state == "succeeded" and agent.coordinator.records[-1].version == 2:
                    break
            assert agent.coordinator.records[-1].state == "succeeded", agent.coordinator.records[-1].error
            rollout, _ = await wait_run_healthy(rollout_url, ADMIN, 60, agent_url, SYNC_TOKEN)
            for url in urls:
                ids, lps, wv = await engine_logprobs(url)
                assert wv == 2 and max(abs(a - b) for a, b in zip(lps, model_logprobs(model2, ids))) < 1e-4
            assert rollout["version"] == 2
            assert time.monotonic() - cut_at < F11_BOUND_S
        finally:
            if partition is not None:
                partition.heal()
            go.set()
            await pub.close()
