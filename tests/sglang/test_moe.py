"""A mixture-of-experts model on real SGLang (issue 53): ``builtin:tiny-moe`` served by SGLang
0.5.23 started with ``--enable-return-routed-experts`` and by local_engine with the same flag
answer the same requests with the same tokens and the same routed experts, row for row (greedy,
from position 0 and from a ``routed_experts_start_len``); a weight sync in the checkpoint's
per-expert names reaches both alike; and a sync in transformers' fused in-memory names is what
SGLang skips *silently* (the update succeeds, the experts keep their old values: why the trainer
sends checkpoint names), where local_engine refuses it with a reason."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from asyncrl.engine_client import EngineClient
from asyncrl.models import load_model
from asyncrl.sync_control.errors import WeightSyncError
from tests.helpers.processes import start_engine
from tests.sglang.conftest import ADMIN_KEY, API_KEY
from tests.sglang_cpu.models import TINY_MOE, tiny_moe_dir
from tests.sglang_cpu.server import start_sglang
from trainer_daemon.policy.model import engine_weights
from trainer_daemon.sync.direct import DirectEnginePublisher
from trainer_daemon.sync.staging import engine_layout

TIMEOUT_S = 120.0
PROMPTS = [[31, 41, 59, 26, 53, 58, 97], [7, 7, 7, 300, 12], list(range(100, 140))]
EXPERT = "model.layers.1.mlp.experts"


async def answers(client: EngineClient) -> list[tuple[list[int], np.ndarray]]:
    """Per prompt and start length: (output ids, routes as [rows, layers, top_k])."""
    out = []
    for prompt in PROMPTS:
        for start in (None, 3):
            extra = {"return_routed_experts": True} | ({"routed_experts_start_len": start} if start is not None else {})
            res = await client._call("POST", "/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}, **extra})
            routes = np.frombuffer(base64.b64decode(res["meta_info"]["routed_experts"]), "<i4").reshape(-1, 4, 2)
            assert len(routes) == len(prompt) + 8 - 1 - (start or 0)
            out.append((res["output_ids"], routes))
    return out


def same(ours, theirs) -> None:
    for (ids_a, routes_a), (ids_b, routes_b) in zip(ours, theirs, strict=True):
        assert ids_a == ids_b
        assert np.array_equal(routes_a, routes_b)


async def test_sglang_and_local_engine_route_a_moe_model_alike_and_load_its_syncs_alike(tmp_path):
    model_dir = tiny_moe_dir()
    with start_sglang(tmp_path, model_dir, "--enable-return-routed-experts", api_key=API_KEY, admin_api_key=ADMIN_KEY,
                      name="sglang-moe") as real, \
            start_engine(tmp_path, "--enable-return-routed-experts", model=str(model_dir), api_key=API_KEY,
                         admin_api_key=ADMIN_KEY, name="local-moe") as local:
        async with real.client(request_timeout_s=TIMEOUT_S) as theirs, local.client(request_timeout_s=TIMEOUT_S) as ours:
            before = await answers(theirs)
            same(await answers(ours), before)

            trained = load_model(TINY_MOE, seed=5)  # other weights, as a trainer would have
            weights = engine_weights(dict(trained.state_dict()), tied=False, dtype=torch.float32)
            fused = {k: v for k, v in weights.items() if k.startswith(EXPERT + ".")}  # gate_up_proj, down_proj
            assert sorted(fused) == [f"{EXPERT}.down_proj", f"{EXPERT}.gate_up_proj"]
            for engine, client in ((real, theirs), (local, ours)):
                pub = DirectEnginePublisher([client], master_address="127.0.0.1", bucket_bytes=1 << 20, group_timeout_s=TIMEOUT_S,
                                            broadcast_timeout_s=TIMEOUT_S, control_timeout_s=TIMEOUT_S)
                try:
                    if engine is real:  # SGLang: "success", nothing loaded
                        await pub.publish(1, fused)
                        assert await client.weight_version() == 1
                        same(await answers(client), before)
                    else:
                        with pytest.raises(WeightSyncError, match="fused in-memory names"):
                            await pub.publish(1, fused)
                    await pub.publish(2, engine_layout(trained, tied=False).to_checkpoint(weights))
                finally:
                    await pub.close()
            after = await answers(theirs)
            assert [ids for ids, _ in after] != [ids for ids, _ in before], "the synced weights answer otherwise"
            same(await answers(ours), after)
