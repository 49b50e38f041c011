"""verl's four modes on the real services, timed: samples/s, idle ratios, pause window, and
the speed-up of (b), (c), (d) over (a) next to the ideal speed-up for the workload.

    python bench/modes.py [--preset default|rollout-bound|long-context] [--decode-ms 10] [--length-median 60] [--length-sigma 1.0] \
        [--length-max 400] [--prefill-ms 0.05] [--train-step-s 2.0] [--samples 64] [--n 4] [--mini 4] [--trigger 4] \
        [--concurrency 64] [--modes a,b,c,d] [--pause-policies abort,retract,in_place,per_request] \
        [--max-model-len 4096] [--tool-turns 0]

The modes are configured as in the seeds' 128-GPU table, cumulatively: (a) trigger 1,
staleness 0; (b) trigger ``--trigger``; (c) (b) + staleness 0.5; (d) (c) + partial rollout.

Engines run in local_engine's timing mode (a decode step sleeps ``--decode-ms``; response
lengths are log-normal: a long tail), the trainer's steps are padded to ``--train-step-s``
(``trainer.step_time_floor_s``), everything else is the real system: NATS, the rollout
service, the sync agent, torchrun. Per mode it runs ``--samples`` prompts and reports
samples/s over the training window (first to last step), the mean ``trainer/idle_ratio`` and
``rollouter/idle_ratio``, the mean sync window (pause to resume, from the sync agent), the
trajectories resumed across a sync and the tokens they kept (``fully_async/partial/*``), and
(d)/(c). ``--preset rollout-bound`` is the case partial rollout exists for: fewer engine slots
than the tail needs, a train step much shorter than a long generation (``PRESETS``).
``--preset long-context`` makes contexts long: ``--tool-turns`` calculator calls per trajectory
(timing mode scripts them), so a later turn's call starts with the whole conversation as its
prompt (five turns of up to 4 000 tokens: contexts up to ~16 000, ``--max-model-len`` 32 768): what ``sync.per_request.resume_max_context``
is for.
``--pause-policies`` runs mode (d) once per ``sync.pause_policy`` and adds the context tokens
the engines prefilled again per sync (``local_engine_recomputed_prefill_tokens``: timing mode
remembers an interrupted request's length, so every policy sees the same workload), the mean
pause phase of the syncs, the trained trajectories' mean oldest lag
(``fully_async/staleness/oldest_lag_mean``), the model tokens the trainer dropped as too stale
(``trainer/dropped_stale_tokens``: decoded for nothing) and the tokens of trajectories the
rollout cancelled for staleness (``rollout/stale_cancelled_tokens``, ``per_request`` only), and
for ``per_request`` the calls its pauses kept / resumed / cancelled.

Ideal speed-ups (ignoring sync cost; B = n × mini trajectories per step, C = trajectories
decoded at once, E[max_m] = expected longest of m draws, E[len] = mean length, d = decode
step, T = train step):
  (a) step = E[max_B]·d + T  (rollout then train, every step)
  (b) with k = trigger steps: per step = (max(E[max_kB]·d, E[max_B]·d + (k−1)T) + T) / k
  (c), (d) throughput bound: per step = max(T, B·E[len]·d / C)
These ignore that a step needs whole groups (a group ends with its slowest of n) and that
the staleness quota caps what is in flight, so (c) and (d) are upper bounds.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.config import load_config, secret  # noqa: E402
from launcher.up.report import read_jsonl  # noqa: E402
from launcher.up.stack import Stack  # noqa: E402
from local_engine.simulated import CALCULATOR_CALL  # noqa: E402


def modes(trigger: int, staleness: float = 0.5) -> dict[str, tuple[str, list[str]]]:
    """verl's modes as the seeds' 128-GPU table runs them: each adds to the previous one
    ((b) = trigger > 1; (c) = (b) + staleness 0.5; (d) = (c) + partial rollout)."""
    t = f"async_training.trigger_parameter_sync_step={trigger}"
    s = f"async_training.staleness_threshold={staleness}"
    return {
        "a": ("on-policy pipeline", ["async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=0"]),
        "b": ("stream off-policy pipeline", [t, "async_training.staleness_threshold=0"]),
        "c": ("async stream, stale samples", [t, s, "async_training.partial_rollout=false"]),
        "d": ("async stream, partial rollout", [t, s, "async_training.partial_rollout=true"]),
    }


def expected_max(m: int, median: float, sigma: float, cap: int, draws: int = 4000) -> float:
    rng = random.Random(1)
    total = 0.0
    for _ in range(draws // max(1, m) + 50):
        total += max(min(cap, math.exp(math.log(median) + sigma * rng.gauss(0, 1))) for _ in range(m))
    return total / (draws // max(1, m) + 50)


def ideal_speedups(a) -> dict[str, float]:
    d, t = a.decode_ms / 1000, a.train_step_s
    b = a.n * a.mini
    mean_len = statistics.fmean(min(a.length_max, math.exp(math.log(a.length_median) + a.length_sigma * random.Random(i).gauss(0, 1)))
                                for i in range(20000))
    step_a = expected_max(b, a.length_median, a.length_sigma, a.length_max) * d + t
    k = a.trigger
    step_b = (max(expected_max(k * b, a.length_median, a.length_sigma, a.length_max) * d,
                  expected_max(b, a.length_median, a.length_sigma, a.length_max) * d + (k - 1) * t) + t) / k
    step_async = max(t, b * mean_len * d / a.concurrency)
    return {"a": 1.0, "b": step_a / step_b, "c": step_a / step_async, "d": step_a / step_async}


def timing_overrides(a) -> list[str]:
    """Each mode starts its own engines (fresh weight versions) in timing mode."""
    t = "engines.local.timing"
    return [f"{t}.enabled=true", f"{t}.decode_ms={a.decode_ms}", f"{t}.length_median={a.length_median}",
            f"{t}.length_sigma={a.length_sigma}", f"{t}.length_max={a.length_max}"]


def tool_overrides(a) -> list[str]:
    """No tools, or ``tool_turns`` scripted calculator calls per trajectory (multi-turn)."""
    if not a.tool_turns:
        return ["rollout.tools=[]"]
    return ['rollout.tools=["calculator"]', f"engines.local.timing.tool_turns={a.tool_turns}",
            f"rollout.multi_turn.max_assistant_turns={a.tool_turns + 1}", f"rollout.multi_turn.max_user_turns={a.tool_turns}"]


async def engine_recomputed_tokens(urls: list[str]) -> float:
    """Sum of ``local_engine_recomputed_prefill_tokens`` over the engines (timing mode)."""
    import aiohttp

    total = 0.0
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(f"{url}/metrics") as r:
                for line in (await r.text()).splitlines():
                    if line.startswith("local_engine_recomputed_prefill_tokens "):
                        total += float(line.split()[1])
    return total


async def run_mode(mode: str, a, root: Path, policy: str = "abort") -> dict:
    run_dir = root / f"mode-{mode}-{policy}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a leftover run would be resumed (checkpoints, stream)
    cfg = load_config(overrides=[
        f"run.dir={run_dir}", f"run.id=bench-{mode}", "model.path=builtin:tiny", f"model.max_model_len={a.max_model_len}",
        f"engines.num_local={a.engines}", f"engines.local.max_batch_size={a.concurrency}", *timing_overrides(a),
        "rollout.port=0", "sync.port=0", "trainer.metrics_port=0", f"rollout.n={a.n}", f"actor.ppo_mini_batch_size={a.mini}",
        f"rollout.total_rollout_steps={a.samples}", *tool_overrides(a), f"rollout.sampling.max_new_tokens={a.length_max + 64}",
        f"rollout.response_length={(a.tool_turns + 1) * (a.length_max + 128)}", f"rollout.max_concurrent={a.concurrency}",
        "trainer.nproc_per_node=1",
        f"trainer.step_time_floor_s={a.train_step_s}", "trainer.checkpoint.save_freq=0", "trainer.checkpoint.export_hf=false",
        "actor.ppo_micro_batch_size_per_gpu=8", "sync.pause_timeout_s=300", *modes(a.trigger, a.staleness)[mode][1],
        f"engines.local.timing.prefill_ms_per_token={a.prefill_ms}", f"sync.pause_policy={policy}",
        *[f"sync.per_request.{kv}" for kv in a.per_request.split(",") if kv],
    ], environ={})
    if a.tool_turns:
        doc = cfg.model_dump()
        doc["engines"]["local"]["timing"]["tool_call"] = CALCULATOR_CALL
        cfg = type(cfg).model_validate(doc)
    stack = Stack(cfg, run_dir)
    t0 = time.monotonic()
    syncs: list[dict] = []
    try:
        cfg = await asyncio.to_thread(stack.start, lambda m: None)
        import aiohttp

        from asyncrl.jetstream import connect
        from launcher.up.live import MetricsTap

        tap = MetricsTap(cfg.run.id, run_dir)
        nc = await connect(stack.urls["nats"], "bench-modes", persistent=False, **stack.nats_auth())
        await tap.start(nc)
        while stack.children["trainer"].poll() is None:
            if any(code not in (None, 0) for _, code in stack.exited()):
                raise RuntimeError(f"a child failed in mode {mode}: {stack.exited()}")
            if time.monotonic() - t0 > a.limit_s:
                raise RuntimeError(f"mode {mode} did not finish within {a.limit_s:.0f} s")
            await asyncio.sleep(0.5)
        recomputed = await engine_recomputed_tokens(list(cfg.engines.urls))
        headers = {"Authorization": f"Bearer {secret(cfg.security.sync_token)}"}
        async with aiohttp.ClientSession() as http, http.get(f"{stack.urls['sync']}/v1/syncs", headers=headers) as r:
            syncs = (await r.json())["syncs"]
        await tap.close()
        await nc.close()
    finally:
        await asyncio.to_thread(stack.stop)
    rows = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    rollout = [r["metrics"] for r in read_jsonl(run_dir / "metrics" / "rollout.jsonl") if r.get("kind") == "rollout"]
    times = [r["time"] for r in rows if "time" in r]
    steps = len(rows)
    window = (times[-1] - times[0]) if len(times) > 1 else float("nan")
    samples_per_step = a.mini
    idle_r = [v for m in rollout if isinstance(v := m.get("rollouter/idle_ratio"), (int, float)) and v == v]
    done = [s for s in syncs if s["state"] == "succeeded"]
    return {
        "mode": mode, "policy": policy, "steps": steps, "recomputed_per_sync": recomputed / max(1, len(done)),
        "samples_per_s": (steps - 1) * samples_per_step / window if window == window and window > 0 else float("nan"),
        "trainer_idle": statistics.fmean(r.get("trainer/idle_ratio", 0.0) for r in rows[1:]) if len(rows) > 1 else float("nan"),
        "rollouter_idle": statistics.fmean(idle_r) if idle_r else float("nan"),
        "sync_window_s": statistics.fmean(sum(s["phase_seconds"].get(p, 0.0) for p in ("pausing", "awaiting_broadcast", "loading", "resuming"))
                                          for s in done) if done else float("nan"),
        "syncs": len(done),
        "kept_tokens": sum(r.get("fully_async/partial/kept_tokens", 0.0) for r in rows),
        "partial": sum(r.get("fully_async/partial/total_partial_num", 0.0) for r in rows),
        "pause_s": statistics.fmean(s["phase_seconds"].get("pausing", 0.0) for s in done) if done else float("nan"),
        "oldest_lag": statistics.fmean(lags) if (lags := [r["fully_async/staleness/oldest_lag_mean"] for r in rows
                                                         if "fully_async/staleness/oldest_lag_mean" in r]) else float("nan"),
        "dropped_tokens": max((r.get("trainer/dropped_stale_tokens", 0.0) for r in rows), default=0.0),
        "cancelled_tokens": max((m.get("rollout/stale_cancelled_tokens", 0.0) for m in rollout), default=0.0),
        "decisions": "/".join(str(sum(int((s.get("pause_outcome") or {}).get(k, 0)) for s in done))
                              for k in ("kept", "resumed", "cancelled")) if policy == "per_request" else "-",
    }


async def main_async(a) -> None:
    root = Path(a.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    results = []
    policies = a.pause_policies.split(",")
    for m in a.modes.split(","):
        for policy in (policies if m == "d" else policies[:1]):
            results.append(await run_mode(m, a, root, policy))
            print(f"mode {m} ({policy}) done: {results[-1]}", flush=True)
    ideal = ideal_speedups(a)
    base = next((r["samples_per_s"] for r in results if r["mode"] == "a"), None)
    print(f"command: python bench/modes.py {' '.join(sys.argv[1:])}")
    print(f"workload: decode {a.decode_ms} ms/step, lengths log-normal(median {a.length_median}, sigma {a.length_sigma}, max {a.length_max}), "
          f"train step {a.train_step_s} s, B = {a.n}x{a.mini} trajectories/step, concurrency {a.concurrency}, "
          f"modes b-d: trigger_parameter_sync_step {a.trigger}, modes c-d: staleness {a.staleness}, prefill {a.prefill_ms} ms/token, "
          f"{a.tool_turns} tool turns, max_model_len {a.max_model_len}")
    width = 48 if len(policies) > 1 else 34
    print(f"{'mode':<{width}} {'samples/s':>10} {'trainer idle':>13} {'rollouter idle':>15} {'sync window s':>14} "
          f"{'speed-up':>9} {'ideal':>7} {'resumed':>8} {'kept tokens':>12} {'re-prefilled/sync':>18} {'pause s':>8} "
          f"{'oldest lag':>11} {'dropped tok':>12} {'cancelled tok':>14} {'kept/res/canc':>14}")
    for r in results:
        speed = r["samples_per_s"] / base if base else float("nan")
        label = f"({r['mode']}) {modes(a.trigger)[r['mode']][0]}" + (f" [{r['policy']}]" if len(policies) > 1 and r["mode"] == "d" else "")
        print(f"{label:<{width}} {r['samples_per_s']:>10.3f} {r['trainer_idle']:>13.2f} {r['rollouter_idle']:>15.2f} "
              f"{r['sync_window_s']:>14.2f} {speed:>9.2f} {ideal[r['mode']]:>7.2f} {r['partial']:>8.0f} {r['kept_tokens']:>12.0f} "
              f"{r['recomputed_per_sync']:>18.0f} {r['pause_s']:>8.3f} {r['oldest_lag']:>11.2f} {r['dropped_tokens']:>12.0f} "
              f"{r['cancelled_tokens']:>14.0f} {r['decisions']:>14}")
    d_runs = {r["policy"]: r["samples_per_s"] for r in results if r["mode"] == "d"}
    if "per_request" in d_runs and len(d_runs) > 1:
        best = max((p for p in d_runs if p != "per_request"), key=lambda p: d_runs[p])
        print(f"per_request / best global policy ({best}): {d_runs['per_request'] / d_runs[best]:.2f}x samples/s")
    by = {r["mode"]: r["samples_per_s"] for r in results if r["policy"] == policies[0]}
    if "c" in by and "d" in by:
        print(f"(d) / (c): {by['d'] / by['c']:.2f}x samples/s")
    if base and "d" in by:
        print(f"(d) / (a): {by['d'] / base:.2f}x = {by['d'] / base / ideal['d']:.0%} of the ideal {ideal['d']:.2f}x")


# Workload presets; explicit flags override them. rollout-bound: fewer engine slots than the
# tail needs and a train step much shorter than a long generation (docs/benchmarks.md).
PRESETS = {
    "default": {},
    "rollout-bound": {"length_median": 100.0, "length_sigma": 1.5, "length_max": 2000, "train_step_s": 0.5,
                      "concurrency": 16, "trigger": 1, "staleness": 2.0, "samples": 32, "limit_s": 1200.0, "modes": "c,d"},
    "long-context": {"length_median": 1000.0, "length_sigma": 0.8, "length_max": 4000, "tool_turns": 4, "max_model_len": 32768,
                     "decode_ms": 2.0, "prefill_ms": 0.05, "train_step_s": 0.5, "concurrency": 16, "trigger": 1,
                     "staleness": 2.0, "samples": 32, "mini": 2, "limit_s": 1800.0, "modes": "d"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--decode-ms", type=float, default=10.0)
    ap.add_argument("--length-median", type=float, default=60.0)
    ap.add_argument("--length-sigma", type=float, default=1.0)
    ap.add_argument("--length-max", type=int, default=400)
    ap.add_argument("--train-step-s", type=float, default=2.0)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--trigger", type=int, default=4, help="trigger_parameter_sync_step of modes b, c, d")
    ap.add_argument("--staleness", type=float, default=0.5, help="staleness_threshold of modes c, d")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--mini", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--modes", default="a,b,c,d")
    ap.add_argument("--prefill-ms", type=float, default=0.05, help="timing mode's prefill latency per prompt token")
    ap.add_argument("--pause-policies", default="abort",
                    help="sync.pause_policy values to run mode (d) with, comma-separated (abort,retract,in_place,per_request)")
    ap.add_argument("--per-request", default="", help="extra sync.per_request settings for per_request, e.g. keep_min_progress=0.3")
    ap.add_argument("--max-model-len", type=int, default=4096, help="model.max_model_len of every run")
    ap.add_argument("--tool-turns", type=int, default=0, help="scripted calculator calls per trajectory (multi-turn contexts)")
    ap.add_argument("--limit-s", type=float, default=600.0)
    ap.add_argument("--out", default="runs/bench-modes")
    pre, _ = ap.parse_known_args()
    ap.set_defaults(**PRESETS[pre.preset])
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
