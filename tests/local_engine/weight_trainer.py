"""A stand-in trainer for the weight-sync tests: rank 0 of a gloo group with one engine.

    python tests/local_engine/weight_trainer.py --engine-url URL --version 1 --perturb-seed 7 \\
        [--bucket-bytes N] [--no-flatten] [--pause abort|in_place|none] [--corrupt-bucket K]

Loads the engine's model (builtin:tiny, seed 0), adds seeded noise (:func:`perturb`, also
imported by the tests to build the expected model), forms the group the way slime does
(fire the engine's init call, join as rank 0, collect), then per bucket fires the HTTP
update call, broadcasts, collects the reply. ``--die-at-bucket K`` exits hard after firing
bucket K's HTTP call (a trainer crash mid-sync). ``--corrupt-bucket K`` declares bucket K's
first tensor with another shape of the same element count (so the broadcast itself still
lines up) to provoke a refused update in the middle of a push. Prints one JSON line:
``{"ok", "buckets", "error", "bucket_done_at": [unix times], "started_at"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import torch

from asyncrl.engine_client import EngineClient
from asyncrl.models import load_model
from asyncrl.weight_sync import WeightSyncError, plan_buckets
from asyncrl.weight_sync.engines import form_group_with_engines, push_bucket

GROUP_TIMEOUT_S = 60.0
DIE_AFTER_S = 1.0  # --die-at-bucket: time for the engine to enter the broadcast before the crash
DIE_EXIT_CODE = 3


@torch.no_grad()
def perturb(model, seed: int, scale: float = 0.05):
    """Add N(0, scale²) noise to every parameter, in named_parameters order (tied weights once)."""
    g = torch.Generator().manual_seed(seed)
    for _, p in model.named_parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


async def run(args) -> dict:
    model = perturb(load_model("builtin:tiny", seed=0), args.perturb_seed)
    named = dict(model.state_dict())  # both embed_tokens and tied lm_head, like a full FSDP state dict
    out: dict = {"ok": False, "buckets": 0, "error": None, "bucket_done_at": [], "started_at": time.time()}
    async with EngineClient(args.engine_url, api_key=args.api_key, admin_api_key=args.admin_api_key, control_timeout_s=GROUP_TIMEOUT_S) as engine:
        group = await form_group_with_engines([engine], "127.0.0.1", timeout_s=GROUP_TIMEOUT_S, group_name=args.group_name)
        out["group_formed_at"] = time.time()
        try:
            if args.pause != "none":
                await engine.pause(args.pause)
                if args.pause == "abort":
                    await engine.flush_cache(retries=5, interval_s=0.2)
            try:
                for i, bucket in enumerate(plan_buckets(named, args.bucket_bytes)):
                    tensors = [named[n] for n in bucket.names]
                    if i == args.die_at_bucket:  # the engine is inside its receive when we vanish
                        asyncio.create_task(engine.update_weights_from_distributed(
                            **bucket.http_fields(), group_name=args.group_name, load_format="flattened_bucket"))
                        await asyncio.sleep(DIE_AFTER_S)
                        os._exit(DIE_EXIT_CODE)
                    if i == args.corrupt_bucket:
                        numel = tensors[0].numel()
                        bucket.shapes[0] = [numel, 1] if len(bucket.shapes[0]) == 1 else [numel]
                    await push_bucket(group, [engine], bucket, tensors, weight_version=args.version,
                                      flattened=not args.no_flatten, timeout_s=GROUP_TIMEOUT_S)
                    out["buckets"] += 1
                    out["bucket_done_at"].append(time.time())
                out["ok"] = True
            finally:
                if args.pause != "none":
                    await engine.resume()
        except WeightSyncError as exc:
            out["error"] = str(exc)
        finally:
            group.destroy()
            try:
                await engine.destroy_weights_update_group(args.group_name)
            except Exception as exc:  # report, do not mask the push result
                out["destroy_error"] = str(exc)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engine-url", required=True)
    p.add_argument("--version", default=None)
    p.add_argument("--perturb-seed", type=int, default=7)
    p.add_argument("--bucket-bytes", type=int, default=256 * 1024)
    p.add_argument("--no-flatten", action="store_true")
    p.add_argument("--pause", choices=["abort", "in_place", "none"], default="abort")
    p.add_argument("--corrupt-bucket", type=int, default=-1)
    p.add_argument("--die-at-bucket", type=int, default=-1, help="crash after sending bucket K's HTTP call, before broadcasting")
    p.add_argument("--group-name", default="weight_update_group")
    p.add_argument("--api-key", default=None)
    p.add_argument("--admin-api-key", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
