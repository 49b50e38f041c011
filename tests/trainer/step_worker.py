"""One training step of ``TrainStep`` on a fixed batch, then the full weights to a file.

    python tests/trainer/step_worker.py OUT.pt "k=v,k=v" "k=v" ...              (one rank)
    torchrun --nproc-per-node 2 tests/trainer/step_worker.py OUT.pt ...          (two ranks)

Optimiser: plain SGD (lr 1), so the weight change is exactly minus the gradient and runs of
different world sizes are comparable to float rounding. The batch has 3 groups of 2 in one
mini-batch with micro-batches of 1, so on 2 ranks one rank holds 4 trajectories and the other
2 + 2 dummy micro-batches. Each argument after OUT is one variant: comma-separated config
overrides (loss knobs, mixed precision...); each variant starts from the initial weights.
OUT holds ``[{"weights", "metrics", "staged", "streamed"}, ...]`` in variant order (``staged``
and ``streamed``: rank 0's weights as the sync's ``buckets`` and ``two_buckets`` staging pack
them, unpacked).
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading

import torch

from asyncrl.config import load_config
from asyncrl.weight_sync import unpack_bucket
from asyncrl.wire import SamplingSpan
from tests.trainer.helpers import make_group
from trainer_daemon.compute.step import StepSettings, TrainStep
from trainer_daemon.policy.distributed import init_distributed
from trainer_daemon.policy.model import (
    attention_for,
    build_policy,
    build_reference,
    build_scheduler,
    full_state_dict,
)
from trainer_daemon.sync.flat import FlatBuffers, send_buckets
from trainer_daemon.sync.staging import WeightStager


def run_variant(ctx, overrides: list[str]) -> dict:
    cfg = load_config(overrides=["rollout.n=2", "actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size_per_gpu=1",
                                 "actor.optim.grad_clip=1000", *overrides], environ={})
    t = cfg.trainer
    attn = attention_for(cfg.actor.attn_implementation, ctx.device, cfg.actor.use_remove_padding)
    a = cfg.actor
    model = build_policy("builtin:tiny", 0, ctx.device, ctx.world_size, t.mixed_precision, a.activation_checkpointing,
                         a.use_torch_compile, attn, (a.lora_rank, a.lora_alpha, a.target_modules) if a.lora_rank else None)
    ref = build_reference("builtin:tiny", 0, ctx.device, ctx.world_size, t.mixed_precision, attn) if cfg.actor.use_kl_loss else None
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = build_scheduler(opt, cfg.actor.optim, None)
    rng = random.Random(5)
    groups = [make_group(rng, f"q{i}", 2, logprob=-6.5) for i in range(3)]
    odd = groups[1][1]  # a longer trajectory with environment tokens (mask 0) and two turns' temperatures
    groups[1][1] = odd.__class__(**{**{f: getattr(odd, f) for f in odd.__struct_fields__},
                                   "token_ids": odd.token_ids + [7, 8, 9], "loss_mask": [1, 1, 0, 0, 0, 1, 1],
                                   "rollout_logprobs": [-6.5, -6.5, 0, 0, 0, -6.5, -6.5],
                                   "weight_versions": [0, 0, -1, -1, -1, 0, 0], "temperature": 0.7,
                                   "sampling": [SamplingSpan(start=0, temperature=0.7), SamplingSpan(start=5, temperature=1.2)]})
    groups[2] = [t.__class__(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "reward": 1.0}) for t in groups[2]]
    trajs = [t for g in groups for t in g]  # group q2 has equal rewards: zero variance
    step = TrainStep(model, opt, sched, StepSettings.from_config(cfg, 0), ctx, ref)
    metrics = step.run(trajs, [[0, 1], [2, 3], [4, 5]])
    # the sync's device-path snapshot (sync.staging=buckets): gathered by every rank, packed on rank 0
    stager = WeightStager(model, tied=bool(model.config.tie_word_embeddings), dtype=torch.bfloat16, bucket_bytes=2**16,
                          device="cpu", is_sender=ctx.is_rank0)
    staged = stager.capture(model)
    unpacked = None
    if staged is not None:
        unpacked = {n: t.clone() for b, flat in zip(staged.buckets, staged.flats, strict=True)
                    for n, t in zip(b.names, unpack_bucket(flat, b.spec().names, b.spec().dtypes, b.spec().shapes), strict=True)}
    return {"weights": full_state_dict(model), "metrics": metrics, "staged": unpacked, "streamed": streamed(ctx, stager, model)}


def streamed(ctx, stager: WeightStager, model) -> dict | None:
    """``sync.staging=two_buckets``: every rank walks the buckets; rank 0 packs them into two
    slots while a publish (a thread here) takes them; what it took, unpacked (rank 0)."""
    stream = stager.open_stream(wait_s=60) if ctx.is_rank0 else None
    got: dict = {}
    consumer = None
    if stream is not None:
        async def send(i, bucket, flat):
            spec = bucket.spec()
            got.update(zip(spec.names, (t.clone() for t in unpack_bucket(flat, spec.names, spec.dtypes, spec.shapes)), strict=True))

        consumer = threading.Thread(target=lambda: asyncio.run(send_buckets(stream.buckets, stream, FlatBuffers(), send)))
        consumer.start()
    stager.stream(model, stream)
    if consumer is None:
        return None
    consumer.join(60)
    return got


def main(out: str, variants: list[str]) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    results = [run_variant(ctx, [o for o in v.split(",") if o]) for v in variants]
    if ctx.is_rank0:
        torch.save(results, out)
    ctx.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
