"""Trainer daemon numbers: the step function's tokens/s against a plain PyTorch loop on the same
model and batch (the daemon's overhead), and weight broadcast to a real local_engine.

    .venv/bin/python bench/trainer.py [--model builtin:tiny] [--batch 16] [--prompt 32] \\
        [--response 96] [--micro 4] [--steps 3] [--pushes 3] [--threads 1] [--no-sync] [--lengths long-tail] \\
        [--override actor.use_remove_padding=false] [--profile]

``--lengths long-tail``: the step part is issue 31's instead (``bench/step_compare.py``): 16
groups × 4, prompt 256, responses log-normal (median 400, sigma 1, cap 4096) and the uniform
batch of the same token count; the daemon's packed step against a plain packed loop, tokens/s,
their ratio and the padding fraction.

Step: one rank (gloo, fp32). *daemon*: ``TrainStep.run`` on the daemon's one-rank policy
(the plain module: FSDP2 only shards over more than one rank; GRPO advantages, plan, collation
every step, ``compute_actor_loss``, clip, AdamW, LR schedule). *plain*: the unwrapped Hugging
Face model, the same micro-batches collated once, log-softmax of the response tokens, a
token-mean policy-gradient loss, backward, clip, AdamW. Tokens/s counts every token of every
trajectory (prompt + response) per optimiser update; one warm-up step each, then ``--steps``
rounds of one daemon step and one plain step, alternating so that both see the same
background load; the medians are compared.

Sync: starts ``python -m local_engine`` with the model on a free loopback port, gathers the
full state dict (timed), measures the link (a gloo broadcast of the same bucket sizes to a
second process, buffers allocated once on both sides: the baseline), then
``DirectEnginePublisher.publish`` 1 + ``--pushes`` times (pause → flattened buckets of
256 MiB → end, flush → continue); prints the first push apart (it forms the group) and the
median of the rest: the pause window (first pause call to the end of continue) split into
pause, transfer (in the collective), load (the engine's validation and copy into its
parameters, plus the HTTP calls per bucket) and resume (end, flush, continue), and whether it
meets issue 13's goal: window <= 1.3 x bytes / link + 0.2 s.
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
    from trainer_daemon.compute.step import StepSettings, TrainStep
    from trainer_daemon.policy.model import (
        attention_for,
        build_optimizer,
        build_policy,
        build_scheduler,
    )

    cfg = load_config(overrides=["rollout.n=4", f"actor.ppo_mini_batch_size={len(trajs) // 4}",
                                 f"actor.ppo_micro_batch_size_per_gpu={args.micro}", *args.override], environ={})
    # the attention the daemon builds for this config (trainer_daemon/daemon.py): on the CPU,
    # packed rows attend per sequence (segmented_sdpa); with plain sdpa they would take a dense
    # T x T mask, a path the daemon never runs (what this bench measured by mistake: issue 49)
    attn = attention_for(cfg.actor.attn_implementation, ctx.device, cfg.actor.use_remove_padding)
    model = build_policy(args.model, 0, ctx.device, 1, attn_implementation=attn)
    opt = build_optimizer(model, cfg.actor.optim)
    step = TrainStep(model, opt, build_scheduler(opt, cfg.actor.optim, None), StepSettings.from_config(cfg, 0), ctx)
    groups = [list(range(i, i + 4)) for i in range(0, len(trajs), 4)]
    return lambda: step.run(trajs, groups)


def plain_step(args, trajs):
    """A plain PyTorch loop on the unwrapped model, the same micro-batches (collated once)."""
    import torch

    from asyncrl.models import load_model
    from trainer_daemon.compute.batch import collate

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


def profile_step(step, rows: int = 15) -> None:
    """The daemon step's operators by self CPU time over two steps (after one warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        step()
    print("daemon step, two steps profiled (torch.profiler, self CPU time):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


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


LINK_CHILD = """
import sys, torch
from asyncrl.weight_sync import join_group
torch.set_num_threads(1)
addr, port, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sizes = [int(x) for x in sys.argv[4:]]
group = join_group(addr, port, 2, 1, timeout_s=120)
bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
for _ in range(rounds):
    for b in bufs:
        group.broadcast(b, 0, 120)
group.destroy()
"""


def link_bandwidth(sizes: list[int], rounds: int) -> float:
    """The link's own speed: a gloo broadcast to another process on this machine, buffers
    allocated once on both sides, ``sizes`` bytes per round (the sync's buckets); GB/s of the
    median round after one warm-up round."""
    import subprocess

    import torch

    from asyncrl.weight_sync import host_group, reserve_listen_socket

    sock = reserve_listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", LINK_CHILD, "127.0.0.1", str(port), str(rounds + 1), *map(str, sizes)],
                             cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    try:
        group = host_group("127.0.0.1", port, 2, timeout_s=120, listen_socket=sock)
        bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]
        times = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            for b in bufs:
                group.broadcast(b, 0, 120)
            times.append(time.perf_counter() - t0)
        group.destroy()
    finally:
        child.wait(timeout=120)
    return sum(sizes) / 1e9 / statistics.median(times[1:])


async def bench_sync(args, ctx) -> None:
    import torch

    from asyncrl.engine_client import EngineClient
    from asyncrl.launch import ChildProcess, free_port, http_ok
    from asyncrl.weight_sync import plan_buckets
    from trainer_daemon.policy.model import build_policy, engine_weights, full_state_dict
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
        bucket_bytes = 256 * 2**20
        link = await asyncio.to_thread(link_bandwidth, [b.nbytes for b in plan_buckets(weights, bucket_bytes)], args.pushes)
        pub = DirectEnginePublisher([EngineClient(url, control_timeout_s=SYNC_TIMEOUT_S)], master_address="127.0.0.1",
                                    bucket_bytes=bucket_bytes, group_timeout_s=SYNC_TIMEOUT_S,
                                    broadcast_timeout_s=SYNC_TIMEOUT_S, control_timeout_s=SYNC_TIMEOUT_S)
        keys = ("timing_s/sync_window", "timing_s/sync_pause", "timing_s/sync_collective", "timing_s/sync_load",
                "timing_s/sync_resume", "timing_s/sync_group")
        runs = []
        try:
            for v in range(1, args.pushes + 2):
                m = await pub.publish(v, weights)
                runs.append([m[k] for k in keys])
        finally:
            await pub.close()
        print(f"sync  {args.model}: {nbytes / 1e6:.1f} MB in {int(m['trainer/sync_buckets'])} bucket(s); "
              f"full state dict gather {gather_s:.3f} s")
        print(f"  link (gloo broadcast between two processes, reused buffers): {link:.2f} GB/s "
              f"-> {nbytes / 1e9 / link:.3f} s for these bytes")

        def show(label: str, r) -> None:
            print(f"  {label}: pause window {r[0]:.3f} s = pause {r[1]:.3f} + transfer {r[2]:.3f} "
                  f"({nbytes / 1e9 / max(r[2], 1e-9):.2f} GB/s) + load {r[3]:.3f} + resume {r[4]:.3f} (+ group {r[5]:.3f})")

        show("first push (forms the group)", runs[0])
        later = sorted(runs[1:], key=lambda r: r[0])
        rest = later[len(later) // 2]
        show(f"later (the median of {len(later)} by window)", rest)
        goal = 1.3 * nbytes / 1e9 / link + 0.2
        print(f"  goal: window <= 1.3 x bytes/link + 0.2 s = {goal:.3f} s; later pushes: {rest[0]:.3f} s "
              f"({'met' if rest[0] <= goal else 'NOT met'})")
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
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the daemon's step (repeatable), e.g. actor.use_remove_padding=false")
    p.add_argument("--profile", action="store_true",
                   help="also print the daemon step's operators by self CPU time (torch.profiler, two steps)")
    p.add_argument("--lengths", choices=["fixed", "long-tail"], default="fixed",
                   help="long-tail: the step part on issue 31's batches instead (bench/step_compare.py: packed "
                        "daemon step vs a plain packed loop, long-tail and uniform lengths, padding)")
    args = p.parse_args()
    print("+ " + shlex.join([".venv/bin/python", "bench/trainer.py", *sys.argv[1:]]))
    if args.lengths == "long-tail":
        from bench import step_compare

        sys.argv = ["bench/step_compare.py", "--model", args.model, "--paths", "packed,plain", "--batches", "long-tail,uniform",
                    "--steps", str(args.steps), "--threads", str(args.threads), "--chunk", "8192"]
        code = step_compare.main()
        if code or args.no_sync:
            return code
        import torch

        from trainer_daemon.policy.distributed import init_distributed

        torch.set_num_threads(args.threads)
        ctx = init_distributed("cpu")
        try:
            asyncio.run(bench_sync(args, ctx))
        finally:
            ctx.destroy()
        return 0

    import torch

    from trainer_daemon.policy.distributed import init_distributed

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
        if args.profile:
            profile_step(daemon_step(args, ctx, trajs))
        if not args.no_sync:
            asyncio.run(bench_sync(args, ctx))
    finally:
        ctx.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
