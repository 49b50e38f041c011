"""LoRA adapter sync against full-weight sync, same engine, same run (issue 36).

    .venv/bin/python bench/lora.py [--model builtin:smollm2-135m] [--rank 16] [--pushes 3]

Starts ``python -m local_engine`` with the model and ``--enable-lora --max-lora-rank <rank>
--lora-target-modules all`` on a free loopback port, builds the policy with peft adapters of
``--rank`` on every linear layer (``actor.target_modules = all-linear``, B drawn at random so
the adapter is not zero), and times, in turns:

- **adapter**: the trainer's snapshot of the adapter (the gather of the trainable parameters
  only, as the daemon takes it) and its spec (encoded tensors, checksums), then the engine
  side as the sync agent runs it (``asyncrl.sync_control.adapter_load``): staging (unload the
  stale adapter, load the new one from tensors beside the current one; nothing paused), then
  the sync sequence (``asyncrl.sync_control.sequence.run_update``: pause → begin → set the
  version → end → flush → continue); the window is pause to the end of continue;
- **merged**: the adapter merged into the full weights and pushed by ``DirectEnginePublisher``
  (pause → flattened buckets of 256 MiB over gloo → end, flush → continue), what a run with
  ``sync.lora_weights = merged`` does; its window is ``timing_s/sync_window``.

Prints bytes moved and the median window of ``--pushes`` pushes of each (after one warm-up push
each: the group's formation, the first adapter load), and the goal: adapter window <= 0.1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINE_START_TIMEOUT_S = 600.0
SYNC_TIMEOUT_S = 300.0
GOAL_S = 0.1
RUN_ID = "bench-lora"


def lora_policy(model_spec: str, rank: int):
    import torch

    from asyncrl.models import load_model
    from trainer_daemon.policy.lora import add_adapters

    model = add_adapters(load_model(model_spec, dtype="float32", seed=0), rank, 2.0 * rank, "all-linear")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    return model


async def adapter_push(url: str, model, cfg, version: int) -> tuple[float, float, float, int, int]:
    """One adapter sync: (prepare s, staging s, window s, tensor bytes, request bytes)."""
    import torch

    from asyncrl.engine_client import EngineClient
    from asyncrl.sync_control.adapter_load import stage_adapter, switch_adapter
    from asyncrl.sync_control.engine_update import EngineUpdate, Member
    from asyncrl.sync_control.pause_policy import pause_plan
    from asyncrl.sync_control.sequence import UpdateSteps, run_update
    from trainer_daemon.policy.lora import adapter_snapshot
    from trainer_daemon.sync.adapter import adapter_spec

    t0 = time.perf_counter()
    snap = adapter_snapshot(model, cfg.actor, cfg.model.path, torch.float32, write=True)
    spec = adapter_spec(snap, version, run_id=RUN_ID, transport="tensors", adapter_dir=ROOT / "runs" / "bench" / "adapters")
    prepare = time.perf_counter() - t0
    plan = pause_plan("abort", False)
    async with EngineClient(url, control_timeout_s=SYNC_TIMEOUT_S) as client:
        update = EngineUpdate([Member("engine", client)], control_timeout_s=SYNC_TIMEOUT_S, total_buckets=1)
        t1 = time.perf_counter()
        staged = await stage_adapter(update, spec, run_id=RUN_ID, keep=version - 1, transport="tensors", timeout_s=SYNC_TIMEOUT_S)
        t2 = time.perf_counter()
        steps = UpdateSteps(load=lambda: switch_adapter(update, staged, spec.name, version, timeout_s=SYNC_TIMEOUT_S),
                            session=False)  # as the sync agent runs an adapter sync
        await run_update(update, plan.engine_mode, plan.flush_retries, steps)
        window = time.perf_counter() - t2
    return prepare, t2 - t1, window, snap.nbytes, len(spec.model_dump_json())


async def main_async(args) -> None:
    import torch

    from asyncrl.config import load_config
    from asyncrl.engine_client import EngineClient
    from asyncrl.launch import ChildProcess, free_port, http_ok
    from trainer_daemon.policy.model import engine_weights
    from trainer_daemon.sync.direct import DirectEnginePublisher

    torch.set_num_threads(args.threads)
    port = free_port()
    engine = ChildProcess("engine", [sys.executable, "-m", "local_engine", "--model", args.model, "--port", str(port),
                                     "--host", "127.0.0.1", "--torch-threads", str(args.threads), "--log-level", "warning",
                                     "--enable-lora", "--max-lora-rank", str(args.rank), "--lora-target-modules", "all"],
                          ROOT / "runs" / "bench" / f"engine-{port}.log").start()
    url = f"http://127.0.0.1:{port}"
    cfg = load_config(overrides=[f"model.path={args.model}", f"actor.lora_rank={args.rank}", f"actor.lora_alpha={2 * args.rank}"],
                      environ={})
    try:
        await asyncio.to_thread(engine.wait_ready, lambda: http_ok(f"{url}/health"), ENGINE_START_TIMEOUT_S)
        model = lora_policy(args.model, args.rank)
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        merged = engine_weights(full, bool(model.config.tie_word_embeddings), torch.float32, 2.0)
        merged_bytes = sum(t.numel() * t.element_size() for t in merged.values())
        pub = DirectEnginePublisher([EngineClient(url, control_timeout_s=SYNC_TIMEOUT_S)], master_address="127.0.0.1",
                                    bucket_bytes=256 * 2**20, group_timeout_s=SYNC_TIMEOUT_S,
                                    broadcast_timeout_s=SYNC_TIMEOUT_S, control_timeout_s=SYNC_TIMEOUT_S)
        adapters, fulls = [], []
        version = 0
        try:
            for i in range(args.pushes + 1):  # in turns: both see the same background load
                version += 1
                a = await adapter_push(url, model, cfg, version)
                version += 1
                m = await pub.publish(version, merged)
                if i:
                    adapters.append(a)
                    fulls.append(m["timing_s/sync_window"])
        finally:
            await pub.close()
        prep = statistics.median(a[0] for a in adapters)
        staging = statistics.median(a[1] for a in adapters)
        window = statistics.median(a[2] for a in adapters)
        nbytes, request = adapters[0][3], adapters[0][4]
        full_window = statistics.median(fulls)
        print(f"lora  {args.model}: rank {args.rank} on every linear layer, {args.pushes} pushes of each after one warm-up "
              f"(medians), torch threads {args.threads}")
        print(f"  adapter sync: {nbytes / 1e6:.1f} MB of tensors ({request / 1e6:.1f} MB request); trainer side "
              f"{prep:.3f} s and staging on the engine {staging:.3f} s, both before the pause; pause window {window:.3f} s "
              f"(per push: {', '.join(f'{a[2]:.3f}' for a in adapters)})")
        print(f"  merged full weights: {merged_bytes / 1e6:.1f} MB; pause window {full_window:.3f} s "
              f"(per push: {', '.join(f'{f:.3f}' for f in fulls)})")
        print(f"  adapter / merged: {nbytes / merged_bytes:.3f}x the bytes, {window / full_window:.2f}x the window")
        print(f"  goal: adapter window <= {GOAL_S} s: {window:.3f} s ({'met' if window <= GOAL_S else 'NOT met'})")
    finally:
        engine.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    asyncio.run(main_async(p.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
