"""A 2-rank torchrun trainer (CPU, gloo, fp32) on trajectories from a real nats-server.

One run serves every test here (module fixture), in phases:

1. started on an empty stream: it must wait, say so (``trainer/waiting_for_data_s``), and
   every socket of its process tree must listen on 127.0.0.1 only;
2. ``STEPS - 1`` steps of the GOOD/BAD task are published: it trains, then waits again, and
   Prometheus is scraped while it is alive;
3. the last step's groups are published and it exits 0.

Measurements, not constants: the log-prob margin of GOOD over BAD on fresh prompts must grow.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.jetstream import connect
from asyncrl.launch import free_port
from asyncrl.models import load_model
from asyncrl.wire import NatsNames
from tests.helpers.waiting import wait_for_sync
from tests.trainer.helpers import (
    BAD,
    GOOD,
    NOT_YET,
    PROMPT_LEN,
    latest_export,
    listening_sockets,
    make_group,
    metrics_lines,
    publish,
    scrape,
    start_trainer,
    wait_exit,
)
from trainer_daemon.rank0 import metrics_endpoint
from trainer_daemon.state.ledger import read_lineage

STEPS = 6
N = 4
GROUPS_PER_STEP = 2
READY_S = 180.0  # two ranks importing torch + transformers on 2 busy cores
IDLE_SEEN_S = 2.0


class MetricsSubscriber:
    """Collects the trainer's core-NATS metrics messages in a background thread."""

    def __init__(self, url: str, subject: str) -> None:
        self.messages: list[bytes] = []
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main(url, subject)), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "metrics subscriber did not connect"

    async def _main(self, url: str, subject: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        nc = await connect(url, "test-metrics", persistent=False)
        await nc.subscribe(subject, cb=self._on)
        await nc.flush()
        self._ready.set()
        await self._stop.wait()
        await nc.close()

    async def _on(self, msg) -> None:
        self.messages.append(msg.data)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def run(module_nats, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("learn") / "run"
    master_port = free_port()
    overrides = [
        f"run.dir={run_dir}", f"nats.url={module_nats.url}", "run.id=learn", f"rollout.n={N}",
        f"actor.ppo_mini_batch_size={GROUPS_PER_STEP}", "actor.ppo_micro_batch_size_per_gpu=2",
        f"trainer.total_training_steps={STEPS}", "trainer.metrics_port=0", f"trainer.master_port={master_port}",
        "trainer.loggers=[\"jsonl\",\"tensorboard\"]", "actor.optim.lr=1e-3", "actor.calculate_entropy=true", "async_training.compute_prox_log_prob=true",
    ]
    cfg = load_config(overrides=overrides, environ={})
    sub = MetricsSubscriber(module_nats.url, NatsNames("learn").metrics("trainer"))
    rng = random.Random(0)
    groups = [make_group(rng, f"g{i}", N) for i in range(STEPS * GROUPS_PER_STEP)]
    # Two members of the last group were spoiled by infrastructure failures: never trained.
    # (One GOOD with reward 1, one BAD with 0, so the batch's mean reward is 0.5 either way:
    # the exclusion shows in the counters and the ledger, not by luck in the rewards.)
    last = groups[-1]
    last[0] = last[0].__class__(**{**{f: getattr(last[0], f) for f in last[0].__struct_fields__}, "failure": "reward_error"})
    last[1] = last[1].__class__(**{**{f: getattr(last[1], f) for f in last[1].__struct_fields__}, "failure": "engine_error",
                                  "finish_reason": "error"})
    out_failed = [last[0].id, last[1].id]
    proc = start_trainer(run_dir, overrides, nproc=2)
    out = {"run_dir": run_dir, "master_port": master_port, "failed": out_failed}
    try:
        url = wait_for_sync(lambda: metrics_endpoint(run_dir), READY_S, "metrics endpoint", procs=[proc], retry_on=NOT_YET)
        out["waiting"] = wait_for_sync(lambda: scrape(url).get("asyncrl_trainer_waiting_for_data_s", 0) >= IDLE_SEEN_S and
                                  scrape(url)["asyncrl_trainer_waiting_for_data_s"], 60, "idle report", procs=[proc], retry_on=NOT_YET)
        out["listeners"] = listening_sockets(proc.pid)
        out["metrics_port"] = int(url.rsplit(":", 1)[1].split("/")[0])
        publish(cfg, [t for g in groups[: (STEPS - 1) * GROUPS_PER_STEP] for t in g])
        wait_for_sync(lambda: len(metrics_lines(run_dir)) >= STEPS - 1, 120, f"{STEPS - 1} steps", procs=[proc], retry_on=NOT_YET)
        out["prometheus"] = scrape(url)
        publish(cfg, [t for g in groups[(STEPS - 1) * GROUPS_PER_STEP:] for t in g])
        out["exit"] = wait_exit(proc)
    finally:
        proc.stop()
        sub.close()
    out["nats_metrics"] = sub.messages
    out["lines"] = metrics_lines(run_dir)
    return out


def test_trainer_exits_cleanly_after_total_steps(run):
    assert run["exit"] == 0
    assert [line["step"] for line in run["lines"]] == list(range(1, STEPS + 1))


@torch.no_grad()
def _margin(model, prompts) -> float:
    """Mean over prompts of sum log p(GOOD) - sum log p(BAD)."""
    total = 0.0
    for prompt in prompts:
        for resp, sign in ((GOOD, 1.0), (BAD, -1.0)):
            ids = torch.tensor([prompt + resp])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
            total += sign * logp.gather(1, torch.tensor(resp).unsqueeze(1)).sum().item()
    return total / len(prompts)


def test_rewarded_responses_become_more_likely(run):
    rng = random.Random(99)  # prompts the trainer never saw
    prompts = [[rng.randrange(300, 1500) for _ in range(PROMPT_LEN)] for _ in range(8)]
    before = _margin(load_model("builtin:tiny", seed=0), prompts)
    after = _margin(load_model(str(latest_export(run["run_dir"]))), prompts)
    assert after > before, f"GOOD-vs-BAD log-prob margin did not grow: {before:.3f} -> {after:.3f}"
    rewards = [line["critic/rewards/mean"] for line in run["lines"]]
    assert rewards == [0.5] * STEPS  # the data is fixed; the model is what changes


def test_infrastructure_failures_are_not_trained(run):
    last = run["lines"][-1]
    assert last["trainer/excluded_trajectories"] == 2
    assert last["trainer/excluded_trajectories/reward_error"] == 1 and last["trainer/excluded_trajectories/engine_error"] == 1
    assert last["trainer/trained_trajectories"] == STEPS * GROUPS_PER_STEP * N - 2
    assert run["lines"][-2]["trainer/excluded_trajectories"] == 0
    ledger = read_lineage(run["run_dir"] / "checkpoints", STEPS)
    trained = {i for e in ledger for i in e.get("trained", [])}
    dropped = {i for e in ledger for i in e.get("dropped", [])}
    assert set(run["failed"]) <= dropped and not set(run["failed"]) & trained


def test_idle_time_reported_while_stream_empty(run):
    assert run["waiting"] >= IDLE_SEEN_S
    first = run["lines"][0]
    assert first["trainer/idle_ratio"] > 0.5 and first["trainer/idle_time_s"] >= IDLE_SEEN_S


def test_every_listener_is_on_loopback(run):
    listeners = run["listeners"]
    ports = {port for _, port, _ in listeners}
    assert run["master_port"] in ports, f"torchrun's store not found among {listeners}"
    assert run["metrics_port"] in ports
    assert len(listeners) >= 4, listeners  # store, metrics, one gloo listener per rank at least
    assert all(ip == "127.0.0.1" for ip, _, _ in listeners), listeners


def test_metrics_use_verl_names_in_every_sink(run):
    keys = set(run["lines"][-1])
    for name in ("trainer/idle_ratio", "fully_async/count/stale_samples_processed",
                 "fully_async/count/stale_trajectory_processed", "fully_async/partial/total_partial_num",
                 "fully_async/partial/partial_ratio", "fully_async/partial/max_partial_span", "critic/rewards/mean",
                 "response_length/mean", "actor/pg_clipfrac", "actor/entropy", "actor/ppo_kl", "actor/grad_norm",
                 "actor/lr", "timing_s/step", "trainer/tokens_per_s", "trainer/dropped_stale_trajectories",
                 "trainer/poison_messages", "trainer/consumer_lag"):
        assert name in keys, name
    prom = run["prometheus"]
    assert prom["asyncrl_trainer_global_step"] == STEPS - 1
    assert "asyncrl_fully_async_partial_partial_ratio" in prom and "asyncrl_actor_grad_norm" in prom
    assert len(run["nats_metrics"]) == STEPS


def test_tensorboard_has_a_scalar_per_step(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run["run_dir"] / "tensorboard" / "trainer"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("trainer/idle_ratio")] == list(range(1, STEPS + 1))
