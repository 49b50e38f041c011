"""A stand-in trainer for local_engine's weight-update tests: rank 0 of a gloo group with one
engine, speaking SGLang's raw protocol so each test can bend one step of it.

    python -m tests.local_engine.weight_trainer --engine-url URL --version 1 --perturb-seed 7 \\
        [--bucket-bytes N] [--no-flatten] [--pause abort|in_place|none] [--no-session] \\
        [--corrupt-bucket K] [--die-at-bucket K] [--tp-size N] [--wait-file PATH]

Loads the engine's model (builtin:tiny, seed 0), adds seeded noise (:func:`perturb`, also
imported by the tests to build the expected model), forms the group the way slime does (fire
the engine's init call, host as rank 0, collect), opens a weight-update session unless
``--no-session`` (a 404 means an older SGLang without sessions), then per bucket fires the
HTTP update call, broadcasts the bucket's packed bytes (or each tensor with ``--no-flatten``)
and collects the reply, watching the reply while broadcasting: a refusal stops the broadcast at
once. ``--die-at-bucket K`` exits hard after firing bucket K's HTTP call (a trainer crash
mid-sync). ``--corrupt-bucket K`` declares bucket K's first tensor with another shape of the
same element count (so the broadcast itself still lines up) to provoke a refused update in the
middle of a push. Prints one JSON line: ``{"ok", "buckets", "error", "bucket_done_at", ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

import torch

from asyncrl.engine_client import EngineClient, EngineError
from asyncrl.models import load_model
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.weight_sync import (
    host_group,
    pack_bucket,
    plan_buckets,
    reserve_listen_socket,
)
from tests.helpers.waiting import wait_for

GROUP_TIMEOUT_S = 60.0
# --die-at-bucket: time for the bucket's HTTP call to reach the engine (one loopback request) so that it is
# inside its receive at the crash. Not a wait for an observable state: the engine shows no "receiving" flag.
DIE_AFTER_S = 1.0
DIE_EXIT_CODE = 3


@torch.no_grad()
def perturb(model, seed: int, scale: float = 0.05):
    """Add N(0, scale²) noise to every parameter, in named_parameters order (tied weights once)."""
    g = torch.Generator().manual_seed(seed)
    for _, p in model.named_parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


async def push(engine: EngineClient, group, spec: dict, tensors, flatten: bool, group_name: str, version) -> None:
    """One bucket: HTTP call first, then the broadcast, the reply watched meanwhile."""
    call = asyncio.ensure_future(engine.update_weights_from_distributed(
        spec["names"], spec["dtypes"], spec["shapes"], group_name=group_name, weight_version=version,
        load_format="flattened_bucket" if flatten else None, flush_cache=False, timeout_s=GROUP_TIMEOUT_S))
    cancel = threading.Event()
    call.add_done_callback(lambda f: f.exception() is not None and cancel.set())
    await asyncio.sleep(0)  # let the call's task start; the broadcast below waits for the engine itself

    def send() -> None:
        if flatten:
            group.broadcast(pack_bucket(tensors), 0, GROUP_TIMEOUT_S, cancel)
        else:
            for t in tensors:
                group.broadcast(t.detach().contiguous(), 0, GROUP_TIMEOUT_S, cancel)

    try:
        await asyncio.to_thread(send)
    except WeightSyncError as exc:
        if call.done() and call.exception() is not None:
            raise WeightSyncError(f"engine refused the bucket: {call.exception()}") from exc
        raise
    await call


async def run(args) -> dict:
    model = perturb(load_model("builtin:tiny", seed=0), args.perturb_seed)
    named = dict(model.state_dict())  # both embed_tokens and tied lm_head, like a full FSDP state dict
    out: dict = {"ok": False, "buckets": 0, "error": None, "bucket_done_at": [], "started_at": time.time()}
    async with EngineClient(args.engine_url, api_key=args.api_key, admin_api_key=args.admin_api_key,
                            control_timeout_s=GROUP_TIMEOUT_S) as engine:
        sock = reserve_listen_socket("127.0.0.1")
        port = sock.getsockname()[1]
        world = 1 + args.tp_size
        join = asyncio.ensure_future(engine.init_weights_update_group("127.0.0.1", port, 1, world, args.group_name, "gloo"))
        group = await asyncio.to_thread(host_group, "127.0.0.1", port, world, group_name=args.group_name,
                                        timeout_s=GROUP_TIMEOUT_S, listen_socket=sock)
        await join
        out["group_formed_at"] = time.time()
        if args.wait_file:
            await wait_for(lambda: os.path.exists(args.wait_file), GROUP_TIMEOUT_S, f"the test's go file {args.wait_file}")
        session = False
        try:
            if args.pause != "none":
                await engine.pause(args.pause)
            if not args.no_session:
                session = out["session"] = await engine.begin_weight_update()
            try:
                for i, bucket in enumerate(plan_buckets(named, args.bucket_bytes)):
                    tensors = [named[n] for n in bucket.names]
                    spec = bucket.spec().model_dump()
                    if i == args.die_at_bucket:  # the engine is inside its receive when we vanish
                        asyncio.ensure_future(engine.update_weights_from_distributed(
                            spec["names"], spec["dtypes"], spec["shapes"], group_name=args.group_name,
                            load_format="flattened_bucket"))
                        await asyncio.sleep(DIE_AFTER_S)
                        os._exit(DIE_EXIT_CODE)
                    if i == args.corrupt_bucket:
                        numel = tensors[0].numel()
                        spec["shapes"][0] = [numel, 1] if len(spec["shapes"][0]) == 1 else [numel]
                    await push(engine, group, spec, tensors, not args.no_flatten, args.group_name, args.version)
                    out["buckets"] += 1
                    out["bucket_done_at"].append(time.time())
                out["ok"] = True
            finally:
                if session:
                    await engine.end_weight_update()
                if args.pause != "none":
                    await engine.resume()
        except (WeightSyncError, EngineError) as exc:
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
    p.add_argument("--version", type=int, default=None)
    p.add_argument("--perturb-seed", type=int, default=7)
    p.add_argument("--bucket-bytes", type=int, default=256 * 1024)
    p.add_argument("--no-flatten", action="store_true")
    p.add_argument("--no-session", action="store_true", help="skip /begin_weight_update (SGLang 0.5.21+ refuses the update)")
    p.add_argument("--pause", choices=["abort", "in_place", "none"], default="abort")
    p.add_argument("--corrupt-bucket", type=int, default=-1)
    p.add_argument("--die-at-bucket", type=int, default=-1, help="crash after sending bucket K's HTTP call, before broadcasting")
    p.add_argument("--wait-file", default=None, help="after forming the group, wait until this file exists")
    p.add_argument("--tp-size", type=int, default=1, help="the engine's TP size: ranks it takes in the group")
    p.add_argument("--group-name", default="weight_update_group")
    p.add_argument("--api-key", default=None)
    p.add_argument("--admin-api-key", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
