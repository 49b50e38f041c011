"""Trainer daemon numbers: the step function's tokens/s against a plain PyTorch loop on the same
model and batch (the daemon's overhead), and weight broadcast to a real local_engine.

    .venv/bin/python bench/trainer.py [--model builtin:tiny] [--batch 16] [--prompt 32] \\
        [--response 96] [--micro 4] [--steps 3] [--pushes 3] [--threads 1] [--no-sync]

Step: one rank (gloo, fp32). *daemon*: ``TrainStep.run`` on the daemon's one-rank policy
(the plain module: FSDP2 only shards over more than one rank; GRPO advantages, plan, collation
every step, ``compute_actor_loss``, clip, AdamW, LR schedule). *plain*: the unwrapped Hugging
Face model, the same micro-batches collated once, log-softmax of the response tokens, a
token-mean policy-gradient loss, backward, clip, AdamW. Tokens/s counts every token of every
trajectory (prompt + response) per optimiser update; one warm-up step each, then ``--steps``
rounds of one daemon step and one plain step, alternating so that both see the same
background load; the medians are compared.

Sync: starts ``python -m local_engine`` with the model on a free loopback port, gathers the
full state dict (timed), then ``DirectEnginePublisher.publish`` ``--pushes`` times (pause →
flush → flattened buckets of 256 MiB → continue); prints the first push apart (page faults)
and the median of the rest: total time, time to send and apply the buckets (the engine answers
after validating and copying them into its parameters) and the part spent in the collective.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINE_START_TIMEOUT_S = 600.0  # first use of builtin:smollm2-135m converts a GGUF
SYNC_TIMEOUT_S = 300.0


def make_batch(batch: int, prompt: int, response: int, n: int = 4):
    import random

    from asyncrl.wire import Trajectory

    rng = random.Random(0)
    out = []
    for g in range(batch // n):
        p = [rng.randrange(300, 1500) for _ in range(prompt)]
        for i in range(n):
            r = [rng.randrange(300, 1500) for _ in range(response)]
            out.append(Trajectory(id=f"{g}-{i}", run_id="bench", group_id=f"g{g}", group_size=n, group_index=i,
                                  prompt_id="p", data_source="bench", token_ids=p + r, prompt_length=prompt,
                                  loss_mask=[1] * response, rollout_logprobs=[-7.0] * response,
                                  weight_versions=[0] * response, reward=float(i % 2)))
    return out


def daemon_step(args, ctx, trajs):
    """The daemon's step function on its one-rank policy: a callable doing one step."""
    from asyncrl.config import load_config
    from trainer_daemon.model import build_optimizer, build_policy, build_scheduler
    from trainer_daemon.step import StepSettings, TrainStep

    cfg = load_config(overrides=["rollout.n=4", f"actor.ppo_mini_batch_size={len(trajs) // 4}",
                                 f"actor.ppo_micro_batch_size_per_gpu={args.micro}"], environ={})
    model = build_policy(args.model, 0, ctx.device, 1)
    opt = build_optimizer(model, cfg.actor.optim)
    step = TrainStep(model, opt, build_scheduler(opt, cfg.actor.optim, None), StepSettings.from_config(cfg, 0), ctx)
    groups = [list(range(i, i + 4)) for i in range(0, len(trajs), 4)]
    return lambda: step.run(trajs, groups)


def plain_step(args, trajs):
    """A plain PyTorch loop on the unwrapped model, the same micro-batches (collated once)."""
    import torch

    from asyncrl.models import load_model
    from trainer_daemon.batch import collate

    model = load_model(args.model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    adv = [float(i % 2) - 0.5 for i in range(len(trajs))]
    mbs = [collate(trajs, list(range(i, min(i + args.micro, len(trajs)))), adv, 0) for i in range(0, len(trajs), args.micro)]
    tokens = float(sum(mb.mask.sum() for mb in mbs))

    def one_step() -> None:
        for mb in mbs:
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=mb.logits_to_keep).logits
            z = logits.gather(1, mb.resp_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
            logp = torch.log_softmax(z, -1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
            (-(mb.advantages * logp * mb.mask).sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return one_step


def alternate(steps: int, **fns) -> dict[str, list[float]]:
    """One warm-up call of each, then ``steps`` rounds calling each once in turn: seconds per
    call. Alternating puts both under the same background load (this machine is shared)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


async def bench_sync(args, ctx) -> None:
    import torch

    from asyncrl.engine_client import EngineClient
    from asyncrl.launch import ChildProcess, free_port, http_ok
    from trainer_daemon.model import build_policy, engine_weights, full_state_dict
    from trainer_daemon.sync.direct import DirectEnginePublisher

    port = free_port()
    engine = ChildProcess("engine", [sys.executable, "-m", "local_engine", "--model", args.model, "--port", str(port),
                                     "--host", "127.0.0.1", "--torch-threads", "1", "--log-level", "warning"],
                          ROOT / "runs" / "bench" / f"engine-{port}.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(engine.wait_ready, lambda: http_ok(f"{url}/health"), ENGINE_START_TIMEOUT_S)
        model = build_policy(args.model, 0, ctx.device, 1)
        t0 = time.perf_counter()
        full = full_state_dict(model)
        gather_s = time.perf_counter() - t0
        weights = engine_weights(full, bool(model.config.tie_word_embeddings), torch.float32)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        pub = DirectEnginePublisher([EngineClient(url, control_timeout_s=SYNC_TIMEOUT_S)], master_address="127.0.0.1",
                                    bucket_bytes=256 * 2**20, group_timeout_s=SYNC_TIMEOUT_S,
                                    broadcast_timeout_s=SYNC_TIMEOUT_S, control_timeout_s=SYNC_TIMEOUT_S)
        runs = []
        try:
            for v in range(1, args.pushes + 1):
                t0 = time.perf_counter()
                m = await pub.publish(v, weights)
                runs.append((time.perf_counter() - t0, m["timing_s/sync_broadcast"], m["trainer/sync_gb_per_s"],
                             m["timing_s/sync_collective"], m["trainer/sync_collective_gb_per_s"], m["timing_s/sync_group"]))
        finally:
            await pub.close()
        print(f"sync  {args.model}: {nbytes / 1e6:.1f} MB in {int(m['trainer/sync_buckets'])} bucket(s); full state dict gather {gather_s:.3f} s")
        def show(label: str, r) -> None:
            print(f"  {label}: total {r[0]:.3f} s; buckets sent and applied {r[1]:.3f} s = {r[2]:.2f} GB/s; "
                  f"of which in the collective {r[3]:.3f} s = {r[4]:.2f} GB/s")

        print(f"  group formation (first push only): {runs[0][5]:.3f} s")
        show("first push ", runs[0])
        rest = runs[1:] or runs
        show(f"later (median of {len(rest)})", [statistics.median(r[i] for r in rest) for i in range(5)])
    finally:
        engine.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--batch", type=int, default=16, help="trajectories per step (groups of 4)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=96)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-sync", action="store_true")
    args = p.parse_args()
    print("+ " + shlex.join([".venv/bin/python", "bench/trainer.py", *sys.argv[1:]]))

    import torch

    from trainer_daemon.distributed import init_distributed

    torch.set_num_threads(args.threads)
    ctx = init_distributed("cpu")
    try:
        trajs = make_batch(args.batch, args.prompt, args.response)
        tokens = sum(len(t.token_ids) for t in trajs)
        times = alternate(args.steps, daemon=daemon_step(args, ctx, trajs), plain=plain_step(args, trajs))
        daemon_s, plain_s = statistics.median(times["daemon"]), statistics.median(times["plain"])
        print(f"step  {args.model}: {len(trajs)} trajectories x {args.prompt}+{args.response} tokens, micro-batch {args.micro}, "
              f"{args.steps} steps each (alternating, medians), torch threads {args.threads}")
        print(f"  daemon TrainStep (1 rank, no FSDP): {tokens / daemon_s:9.1f} tok/s  ({daemon_s:.3f} s/step)")
        print(f"  plain PyTorch loop                : {tokens / plain_s:9.1f} tok/s  ({plain_s:.3f} s/step)")
        print(f"  daemon / plain: {plain_s / daemon_s:.2f}x the plain loop's throughput "
              f"(per round: {', '.join(f'{p / d:.2f}' for d, p in zip(times['daemon'], times['plain'], strict=True))})")
        if not args.no_sync:
            asyncio.run(bench_sync(args, ctx))
    finally:
        ctx.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
