"""A training step of ``builtin:tiny-moe`` with and without routing replay, one rank (a
subprocess of tests/trainer/test_router_replay_batches.py).

    python tests/trainer/replay_worker.py OUT.pt

Three steps from the same weights on the same 3 groups of 2 (plain SGD, lr 1: the weight change
is minus the gradient): ``plain`` (``actor.router_replay.mode = disabled``), ``own`` (R3 with
each trajectory's routes from a forward of the same weights: the policy's own choice) and
``other`` (R3 with routes shifted to other experts). OUT holds each step's metrics and update.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

from asyncrl.config import load_config
from asyncrl.models import load_model
from asyncrl.wire import RoutedExperts
from local_engine.routes import RouteRecorder
from tests.trainer.helpers import make_group
from trainer_daemon.compute.step import StepSettings, TrainStep
from trainer_daemon.policy.distributed import init_distributed
from trainer_daemon.policy.model import (
    attention_for,
    build_policy,
    build_scheduler,
    full_state_dict,
)

MODEL = "builtin:tiny-moe"


def with_routes(trajs, shift: int):
    model = load_model(MODEL, dtype="float32", seed=0)
    rec = RouteRecorder(model)
    out = []
    for t in trajs:
        with torch.no_grad():
            model(input_ids=torch.tensor([t.token_ids]))
        rows = rec.take()[:-1].numpy().astype(np.int64)
        rows = (rows + shift) % 8
        r = RoutedExperts(layers=rows.shape[1], top_k=rows.shape[2], width=1, rows=rows.astype("<u1").tobytes())
        out.append(t.__class__(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "routed_experts": r}))
    return out


def step(ctx, mode: str, trajs) -> dict:
    cfg = load_config(overrides=["rollout.n=2", "actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size_per_gpu=2",
                                 "actor.optim.grad_clip=1000", f"actor.router_replay.mode={mode}"], environ={})
    attn = attention_for(cfg.actor.attn_implementation, ctx.device, cfg.actor.use_remove_padding)
    model = build_policy(MODEL, 0, ctx.device, ctx.world_size, "fp32", False, False, attn)
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    train = TrainStep(model, opt, build_scheduler(opt, cfg.actor.optim, None), StepSettings.from_config(cfg, 0), ctx)
    metrics = train.run(trajs, [[0, 1], [2, 3], [4, 5]])
    after = full_state_dict(model)
    return {"metrics": metrics, "update": torch.cat([(after[k] - before[k]).flatten() for k in sorted(before)])}


def main(out: str) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    rng = random.Random(5)
    trajs = [t for i in range(3) for t in make_group(rng, f"q{i}", 2, logprob=-6.5)]
    results = {"plain": step(ctx, "disabled", trajs), "own": step(ctx, "R3", with_routes(trajs, 0)),
               "other": step(ctx, "R3", with_routes(trajs, 3))}
    if ctx.is_rank0:
        torch.save(results, out)
    ctx.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
