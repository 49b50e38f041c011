"""The rollout service at scale: timing-mode engines (no model compute), more and more agents.

    python bench/control_plane.py [--engines 1,4,16] [--agents 64,256,1024,4096] [--shapes short,multi]
        [--decode-ms 30] [--length-median 40] [--length-sigma 0.5] [--length-max 400] [--tool-turns 2]
        [--n 4] [--warmup-s 20] [--window-s 30]

Each cell starts NATS, ``E`` local engines in timing mode and the rollout service (the real
one, ``asyncrl rollout``, as ``asyncrl up`` starts it), with ``rollout.max_concurrent`` = the
agents and every engine batching all of its share. The script itself plays the trainer: it
drains the run's stream with the trainer's durable consumer name, so the service's queue
probe sees the consumption, and the staleness quota is set out of reach (no syncs: this
measures the control plane, not the sync). ``short``: one turn, no tools. ``multi``: the
calculator tool; timing mode ends the first ``--tool-turns`` responses with a calculator
call (``engines.local.timing.tool_call``), so every trajectory has ``tool_turns + 1`` model
turns and ``tool_turns`` tool calls (checked on the consumed trajectories).

After ``--warmup-s`` it measures a ``--window-s`` window and prints per cell:

- ``traj/s`` consumed from the stream, and ``ideal``: agents / (expected time of one
  trajectory with every engine step taking exactly ``--decode-ms``), i.e. what the workload
  would give with a free control plane and engines that never wait for a CPU;
- ``in flight``: mean trajectories in flight (``asyncrl_rollout_active_trajectories``);
- ``rollout CPU``: the service process's CPU time over the window as a share of one core
  (it runs one event loop), and per trajectory in ms; ``capacity`` = traj/s / CPU share,
  the rate one core of the service would sustain at this cost;
- ``engines CPU`` (all engine processes, in cores) and the bench's own consumer CPU: on this
  2-core machine the engines' Python work competes with the service;
- JetStream publish latency p50/p99 over the window from the service's histograms
  (``asyncrl_rollout_publish_request_seconds``: request to PubAck; ``..._delay_seconds``:
  outbox write to PubAck), interpolated within buckets as Prometheus' histogram_quantile;
- the service's RSS, and at the end, the memory per in-flight agent: the slope of RSS over
  mean in-flight trajectories across the cells of one engine count and shape.

``lag``: the service's event-loop lag p50/p99 (``asyncrl_rollout_event_loop_lag_seconds``).
``bound`` says what limited the cell: ``rollout`` when the service used >= 90 % of a core;
else ``cpu`` when the machine's cores were >= 90 % busy (all processes: engines, NATS, the
service, this script); else ``rollout loop`` when the service's loop lag p99 reached 50 ms
with CPU to spare (the loop waits on something: a blocking call, a lock); else ``workload``
(the engines' pacing).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.config import load_config  # noqa: E402
from asyncrl.jetstream import connect  # noqa: E402
from asyncrl.wire import NatsNames, decode_trajectory, is_end_of_data  # noqa: E402
from launcher.up.stack import Stack  # noqa: E402
from local_engine.simulated import CALCULATOR_CALL as CALL  # noqa: E402

LATENCY = ("asyncrl_rollout_publish_request_seconds", "asyncrl_rollout_publish_delay_seconds",
           "asyncrl_rollout_event_loop_lag_seconds")
LAG_LIMIT_S = 0.05  # event-loop lag p99 above this: the service's loop is saturated


@dataclass
class Snapshot:
    t: float
    consumed: int
    rollout_cpu: float
    engines_cpu: float
    own_cpu: float
    busy_cpu: float
    metrics: dict[str, dict[str, float]]


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def histograms(text: str) -> dict[str, dict[str, float]]:
    """The publish-latency histograms (cumulative ``le`` buckets) and the other counters read."""
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if fam.name in LATENCY and s.name.endswith("_bucket"):
                out.setdefault(fam.name, {})[s.labels["le"]] = s.value
            elif s.name in ("asyncrl_rollout_active_trajectories", "asyncrl_rollout_tokens_decoded_total",
                            "asyncrl_rollout_published_total"):
                out.setdefault("scalar", {})[s.name] = s.value
    return out


def quantile(q: float, before: dict[str, float], after: dict[str, float]) -> float:
    """histogram_quantile over the window's bucket increments (linear within a bucket)."""
    bounds = sorted(((float(le), after[le] - before.get(le, 0.0)) for le in after), key=lambda x: x[0])
    total = bounds[-1][1]
    if total <= 0:
        return float("nan")
    rank, prev_le, prev_n = q * total, 0.0, 0.0
    for le, n in bounds:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / max(1e-12, n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


def mean_length(a, at_least: int = 1) -> float:
    """Mean response length of timing mode's draw (a tool turn holds at least the call + EOS)."""
    rng = random.Random(0)
    draws = [max(at_least, min(a.length_max, round(math.exp(math.log(a.length_median) + a.length_sigma * rng.gauss(0, 1)))))
             for _ in range(20000)]
    return statistics.fmean(draws)


def ideal_rate(a, agents: int, shape: str, call_tokens: int) -> float:
    """Trajectories/s with a free control plane: each agent always has a request decoding."""
    tokens = mean_length(a)
    if shape == "multi":
        tokens += a.tool_turns * mean_length(a, call_tokens + 1)
    return agents / (tokens * a.decode_ms / 1000.0)


class Drain:
    """The bench's trainer: drains the stream with the trainer's durable consumer name."""

    def __init__(self) -> None:
        self.consumed = 0
        self.turns: list[int] = []
        self.calls: list[int] = []
        self._stop = asyncio.Event()

    async def run(self, url: str, run_id: str, auth: dict) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig

        names = NatsNames(run_id)
        nc = await connect(url, "bench-control-plane", persistent=False, **auth)
        js = nc.jetstream()
        sub = await js.pull_subscribe(names.trajectories, durable=names.trainer_consumer, stream=names.stream,
                                      config=ConsumerConfig(ack_policy=AckPolicy.NONE, max_ack_pending=-1))
        try:
            while not self._stop.is_set():
                try:
                    msgs = await sub.fetch(512, timeout=0.5)
                except TimeoutError:
                    continue
                for m in msgs:
                    if len(self.turns) < 2000 and not is_end_of_data(m.headers):
                        t = decode_trajectory(m.data)
                        self.turns.append(t.num_turns)
                        self.calls.append(t.num_tool_calls)
                self.consumed += len(msgs)
        finally:
            await nc.close()

    def stop(self) -> None:
        self._stop.set()


async def snapshot(http: aiohttp.ClientSession, url: str, drain: Drain, rollout: psutil.Process,
                   engines: list[psutil.Process]) -> Snapshot:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    return Snapshot(time.monotonic(), drain.consumed, cpu_s(rollout), sum(cpu_s(e) for e in engines),
                    cpu_s(psutil.Process()), sum(psutil.cpu_times()[:3]), histograms(text))


async def run_cell(a, root: Path, engines: int, agents: int, shape: str) -> dict:
    run_dir = root / f"cp-{engines}-{agents}-{shape}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t = "engines.local.timing"
    multi = shape == "multi"
    overrides = [
        f"run.dir={run_dir}", f"run.id=cp-{engines}-{agents}-{shape}", "model.path=builtin:tiny", "model.max_model_len=4096",
        f"engines.num_local={engines}", f"engines.local.max_batch_size={math.ceil(agents / engines)}",
        f"{t}.enabled=true", f"{t}.decode_ms={a.decode_ms}", f"{t}.length_median={a.length_median}",
        f"{t}.length_sigma={a.length_sigma}", f"{t}.length_max={a.length_max}", f"{t}.prefill_ms_per_token=0",
        "rollout.port=0", "sync.port=0", "trainer.metrics_port=0", f"rollout.n={a.n}", f"rollout.max_concurrent={agents}",
        f"rollout.sampling.max_new_tokens={a.length_max + 64}", f"rollout.response_length={(a.tool_turns + 1) * (a.length_max + 128)}",
        "rollout.total_epochs=100000", "async_training.staleness_threshold=100", "async_training.trigger_parameter_sync_step=100000",
        "actor.ppo_mini_batch_size=64", "rollout.outbox_max_items=100000",
    ]
    if multi:
        overrides += ['rollout.tools=["calculator"]', f"{t}.tool_turns={a.tool_turns}",
                      f"rollout.multi_turn.max_assistant_turns={a.tool_turns + 1}", f"rollout.multi_turn.max_user_turns={a.tool_turns}"]
    else:
        overrides += ["rollout.tools=[]"]
    cfg = load_config(overrides=overrides, environ={})
    if multi:
        doc = cfg.model_dump()
        doc["engines"]["local"]["timing"]["tool_call"] = CALL
        cfg = type(cfg).model_validate(doc)
    stack = Stack(cfg, run_dir)
    drain = Drain()
    try:
        cfg = await asyncio.to_thread(stack.start, lambda m: None, False)
        url = stack.urls["rollout"]
        rollout = psutil.Process(stack.children["rollout"].proc.pid)
        engine_procs = [psutil.Process(stack.children[f"engine-{i}"].proc.pid) for i in range(engines)]
        consumer = asyncio.create_task(drain.run(stack.urls["nats"], cfg.run.id, stack.nats_auth()))
        async with aiohttp.ClientSession() as http:
            await asyncio.sleep(a.warmup_s)
            if exited := stack.exited():
                raise RuntimeError(f"a child exited: {exited}")
            start = await snapshot(http, url, drain, rollout, engine_procs)
            active: list[float] = []
            while time.monotonic() - start.t < a.window_s:
                await asyncio.sleep(min(2.0, a.window_s / 5))
                async with http.get(f"{url}/metrics") as r:
                    active.append(histograms(await r.text())["scalar"]["asyncrl_rollout_active_trajectories"])
            end = await snapshot(http, url, drain, rollout, engine_procs)
            rss = rollout.memory_info().rss
        drain.stop()
        await consumer
    finally:
        await asyncio.to_thread(stack.stop)
    wall = end.t - start.t
    done = end.consumed - start.consumed
    share = (end.rollout_cpu - start.rollout_cpu) / wall
    busy = (end.busy_cpu - start.busy_cpu) / wall / psutil.cpu_count()
    lat = {name: (quantile(0.5, start.metrics.get(name, {}), end.metrics[name]),
                  quantile(0.99, start.metrics.get(name, {}), end.metrics[name])) for name in LATENCY if name in end.metrics}
    tokens = end.metrics["scalar"]["asyncrl_rollout_tokens_decoded_total"] - start.metrics["scalar"]["asyncrl_rollout_tokens_decoded_total"]
    from asyncrl.models import load_tokenizer

    call_tokens = len(load_tokenizer("builtin:tiny").encode(CALL, add_special_tokens=False))
    rate = done / wall
    return {
        "engines": engines, "agents": agents, "shape": shape, "traj_s": rate, "ideal": ideal_rate(a, agents, shape, call_tokens),
        "tokens_s": tokens / wall, "in_flight": statistics.fmean(active) if active else float("nan"),
        "rollout_cpu": share, "cpu_ms_per_traj": 1000 * share / rate if rate else float("nan"),
        "capacity": rate / share if share > 0 else float("nan"),
        "engines_cpu": (end.engines_cpu - start.engines_cpu) / wall, "bench_cpu": (end.own_cpu - start.own_cpu) / wall,
        "busy": busy, "pub_req": lat.get(LATENCY[0]), "pub_delay": lat.get(LATENCY[1]), "lag": lat.get(LATENCY[2]),
        "rss_mib": rss / 2**20,
        "turns": statistics.fmean(drain.turns) if drain.turns else float("nan"),
        "calls": statistics.fmean(drain.calls) if drain.calls else float("nan"),
        "bound": bound(share, busy, lat.get(LATENCY[2])),
    }


def bound(share: float, busy: float, lag: tuple[float, float] | None) -> str:
    """What limited a cell (module docstring)."""
    if share >= 0.9:
        return "rollout"
    if busy >= 0.9:
        return "cpu"
    if lag is not None and lag[1] >= LAG_LIMIT_S:
        return "rollout loop"
    return "workload"


def ms(pair) -> str:
    return "-" if pair is None else f"{1000 * pair[0]:.1f}/{1000 * pair[1]:.1f}"


def report(rows: list[dict]) -> None:
    print(f"{'eng':>3} {'agents':>6} {'shape':>5} {'traj/s':>7} {'ideal':>7} {'tok/s':>7} {'in flight':>9} {'turns':>5} "
          f"{'rollout CPU':>11} {'ms/traj':>7} {'capacity':>8} {'engines':>7} {'busy':>5} {'publish p50/p99 ms':>18} "
          f"{'delay p50/p99 ms':>17} {'lag p50/p99 ms':>15} {'RSS MiB':>7} bound")
    for r in rows:
        print(f"{r['engines']:>3} {r['agents']:>6} {r['shape']:>5} {r['traj_s']:>7.1f} {r['ideal']:>7.1f} {r['tokens_s']:>7.0f} "
              f"{r['in_flight']:>9.0f} {r['turns']:>5.2f} {100 * r['rollout_cpu']:>10.0f}% {r['cpu_ms_per_traj']:>7.2f} "
              f"{r['capacity']:>8.0f} {r['engines_cpu']:>7.2f} {100 * r['busy']:>4.0f}% {ms(r['pub_req']):>18} "
              f"{ms(r['pub_delay']):>17} {ms(r['lag']):>15} {r['rss_mib']:>7.0f} {r['bound']}")
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["engines"], r["shape"]), []).append(r)
    for (engines, shape), g in groups.items():
        if len(g) >= 2:
            xs, ys = [r["in_flight"] for r in g], [r["rss_mib"] for r in g]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-9, sum((x - mx) ** 2 for x in xs))
            print(f"memory per in-flight agent ({engines} engines, {shape}): {1024 * slope:.1f} KiB (RSS slope over {len(g)} cells)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="1,4,16")
    ap.add_argument("--agents", default="64,256,1024,4096")
    ap.add_argument("--shapes", default="short,multi")
    ap.add_argument("--decode-ms", type=float, default=30.0, help="one batched decode step of a timing engine")
    ap.add_argument("--length-median", type=float, default=40.0)
    ap.add_argument("--length-sigma", type=float, default=0.5)
    ap.add_argument("--length-max", type=int, default=400)
    ap.add_argument("--tool-turns", type=int, default=2, help="tool calls per multi-turn trajectory")
    ap.add_argument("--n", type=int, default=4, help="rollout.n (trajectories per prompt)")
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--dir", default="runs/bench-control-plane")
    a = ap.parse_args()
    rows = []
    for engines in (int(x) for x in a.engines.split(",")):
        for shape in a.shapes.split(","):
            for agents in (int(x) for x in a.agents.split(",")):
                row = asyncio.run(run_cell(a, Path(a.dir).resolve(), engines, agents, shape))
                rows.append(row)
                report([row])
                sys.stdout.flush()
    print()
    report(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
