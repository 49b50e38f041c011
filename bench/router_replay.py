"""The trainer step's overhead from routing replay (issue 53): ``TrainStep.run`` on a Qwen3-MoE
model with ``actor.router_replay.mode`` disabled against R3, on the same batch, alternating
rounds (medians), plus the flip rate the replayed routes show.

    .venv/bin/python bench/router_replay.py [--model builtin:tiny-moe | --shape qwen3-moe-30b-a3b-3l] \\
        [--device cpu|cuda] [--groups 8 --n 4 --prompt 128 --response 384] [--budget 8192] [--rounds 3]

The batch: ``--groups`` × ``--n`` trajectories of ``--prompt`` + ``--response`` random tokens,
each carrying routes for every position (``routed_experts``): the model's own top-k of a first
forward, so that R3 replays what the live router would pick but where the steps' updates have
moved the router since (the bench reports the flip rate the replay path measures: a few % after
the warm-up's and the rounds' optimiser steps). Paths: *live* (``disabled``) and *replay* (``R3``), each a
``TrainStep`` of the daemon (packed rows, AdamW, bf16 autocast on CUDA, fp32 on the CPU), timed
after one warm-up step. Prints each path's seconds per step, tokens/s, and the ratio.

``--shape qwen3-moe-30b-a3b-3l``: Qwen3-30B-A3B's configuration (128 experts, top 8, hidden
2048, expert width 768) with 3 of its 48 layers, random weights (speed does not depend on
their values), saved once under ``--work``: two copies (one per path, 2.4 B parameters each) fit
one 80 GB+ GPU with AdamW over fp32 weights. Record the figure
with the device's name (docs/benchmarks.md, "Router replay").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # Qwen3-30B-A3B's config.json with fewer layers
    "qwen3-moe-30b-a3b-3l": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=3,
                                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                                 num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False,
                                 max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, decoder_sparse_step=1,
                                 mlp_only_layers=[]),
}


def shape_dir(shape: str, work: Path) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = work / f"{shape}-random"
    if (out / "COMPLETE").is_file():
        return out
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPES[shape])).save_pretrained(out)
    (out / "COMPLETE").write_text("random weights, seed 0\n")
    return out


def own_routes(model, ids: list[int], device):
    """The model's own top-k experts of every position but the last (``RoutedExperts``)."""
    import torch

    from asyncrl.wire import RoutedExperts
    from asyncrl.wire.routed_experts import width_for

    picks = []

    def hook(_module, _args, out):
        logits = out[0] if isinstance(out, tuple) else out
        picks.append(torch.topk(logits.float(), model.config.num_experts_per_tok, dim=-1).indices.cpu())

    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids], device=device))
    finally:
        for h in handles:
            h.remove()
    rows = torch.stack([p.reshape(len(ids), -1) for p in picks], 1)[:-1]  # [positions - 1, layers, top_k]
    width = width_for(model.config.num_experts)
    return RoutedExperts(layers=len(gates), top_k=model.config.num_experts_per_tok, width=width,
                         rows=rows.numpy().astype("<u1" if width == 1 else "<u2").tobytes())


def make_step(a, spec: str, ctx, mode: str):
    from asyncrl.config import load_config
    from trainer_daemon.compute.step import StepSettings, TrainStep
    from trainer_daemon.policy.model import (
        attention_for,
        build_optimizer,
        build_policy,
        build_scheduler,
    )

    cfg = load_config(overrides=[
        f"model.path={spec}", f"rollout.n={a.n}", f"actor.ppo_mini_batch_size={a.groups}",
        f"model.max_model_len={a.prompt + a.response}", f"actor.ppo_max_token_len_per_gpu={a.budget}",
        f"actor.router_replay.mode={mode}", f"trainer.mixed_precision={'bf16' if ctx.device.type == 'cuda' else 'fp32'}",
    ], environ={})
    attn = attention_for(cfg.actor.attn_implementation, ctx.device, True)
    model = build_policy(spec, 0, ctx.device, 1, cfg.trainer.mixed_precision, attn_implementation=attn)
    opt = build_optimizer(model, cfg.actor.optim)
    return model, TrainStep(model, opt, build_scheduler(opt, cfg.actor.optim, None), StepSettings.from_config(cfg, 0), ctx)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny-moe")
    p.add_argument("--shape", choices=sorted(SHAPES), help="a Qwen3-MoE shape with random weights (instead of --model)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--response", type=int, default=384)
    p.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("/tmp/asyncrl-bench"))
    a = p.parse_args()

    import torch

    from trainer_daemon.policy.distributed import init_distributed

    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    spec = str(shape_dir(a.shape, a.work)) if a.shape else a.model
    ctx = init_distributed(a.device)
    try:
        return run(a, spec, ctx, device)
    finally:
        ctx.destroy()


def run(a, spec: str, ctx, device) -> int:
    import torch

    from asyncrl.wire import Trajectory

    live_model, live = make_step(a, spec, ctx, "disabled")
    replay_model, replay = make_step(a, spec, ctx, "R3")
    rng = random.Random(0)
    vocab = live_model.config.vocab_size
    trajs = []
    for k in range(a.groups * a.n):
        g, i = divmod(k, a.n)
        ids = [rng.randrange(3, vocab) for _ in range(a.prompt + a.response)]
        trajs.append(Trajectory(id=f"{g}-{i}", run_id="bench", group_id=f"g{g}", group_size=a.n, group_index=i, prompt_id="p",
                                data_source="bench", token_ids=ids, prompt_length=a.prompt, loss_mask=[1] * a.response,
                                rollout_logprobs=[-7.0] * a.response, weight_versions=[0] * a.response, reward=float(i % 2),
                                routed_experts=own_routes(replay_model, ids, device)))
    groups = [list(range(i, i + a.n)) for i in range(0, len(trajs), a.n)]
    tokens = sum(len(t.token_ids) for t in trajs)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    paths = {"live": lambda: live.run(trajs, groups), "replay": lambda: replay.run(trajs, groups)}
    metrics = {}
    for name, fn in paths.items():  # warm-up
        metrics[name] = fn()
        sync()
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(a.rounds):
        for name, fn in paths.items():
            sync()
            t0 = time.perf_counter()
            metrics[name] = fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({a.threads} threads)"
    print(f"router replay on {name}: {spec}, {len(trajs)} trajectories x {a.prompt}+{a.response} tokens, "
          f"{sum(p.numel() for p in live_model.parameters()) / 1e6:.1f} M parameters", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:6s}: {v:.3f} s per step (rounds {', '.join(f'{x:.3f}' for x in times[k])}), {tokens / v:,.0f} tokens/s")
    flips = metrics["replay"].get("actor/router_replay/flip_rate")
    print(f"  replay / live: {med['live'] / med['replay']:.3f}x the live step's throughput "
          f"(overhead {100 * (med['replay'] / med['live'] - 1):+.1f} %); flip rate on its own routes {flips}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
