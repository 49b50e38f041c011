"""Issue 53: local_engine returns routed experts as SGLang does (local_engine/routes.py):
``--enable-return-routed-experts``, ``return_routed_experts`` / ``routed_experts_start_len``,
``meta_info["routed_experts"]`` = base64 int32 ``(prompt + completion - 1 - start_len, layers,
top_k)`` on the final answer only. The rows are the routers' own top-k of a teacher-forced
forward of the same weights (a row may differ only where that forward's k-th and (k+1)-th
probabilities are closer than float noise), batched requests included; a retract keeps the
prompt's routes with its KV; an abort of a running request reports its partial rows; with the
flag off nothing is added; a dense model refuses to start with the flag."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from asyncrl.models import load_model
from asyncrl.wire.routed_experts import engine_rows
from local_engine.routes import RouteRecorder
from tests.helpers.processes import SEED, start_engine
from tests.helpers.waiting import wait_for
from tests.local_engine.helpers import running_tokens

MOE = "builtin:tiny-moe"
LAYERS, TOP_K, EXPERTS = 4, 2, 8
PROMPT = [11, 42, 7, 99, 301, 5, 17, 260]
NOISE = 1e-4  # a top-k choice this close to the next expert may flip between two fp32 computations


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    with start_engine(tmp_path_factory.mktemp("moe"), "--enable-return-routed-experts", "--max-batch-size", "4",
                      model=MOE, name="engine-moe") as e:
        yield e


@pytest.fixture(scope="module")
def reference():
    model = load_model(MOE, dtype="float32", seed=SEED)
    return model, RouteRecorder(model)


@torch.inference_mode()
def teacher_routes(reference, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's top-k experts over ``ids`` (one full forward) and whether every layer's
    choice there is clear of float noise (k-th and (k+1)-th probabilities apart by > NOISE)."""
    model, recorder = reference
    logits: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, out: logits.append(out[0].float())) for r in recorder.routers]
    try:
        model(input_ids=torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    clear = torch.ones(len(ids), dtype=torch.bool)
    for layer_logits in logits:
        top = layer_logits.softmax(-1).topk(TOP_K + 1, dim=-1).values
        clear &= (top[:, TOP_K - 1] - top[:, TOP_K]) > NOISE
    return recorder.take(), clear


async def _tokens_over(client, n: int) -> bool:
    return await running_tokens(client) > n


async def generate(url: str, **body) -> dict:
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{url}/generate", json={"input_ids": PROMPT, **body})
        assert r.status_code == 200, r.text
        return r.json()


def rows_of(res: dict) -> torch.Tensor:
    return torch.from_numpy(engine_rows(res["meta_info"]["routed_experts"], LAYERS, TOP_K))


async def test_routes_are_the_models_own_for_every_position(moe_engine, reference):
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    results = await asyncio.gather(*(generate(moe_engine.url, input_ids=PROMPT[: 4 + i], sampling_params=sp,
                                              return_routed_experts=True) for i in range(4)))  # one left-padded batch
    for i, res in enumerate(results):
        prompt, out, meta = PROMPT[: 4 + i], res["output_ids"], res["meta_info"]
        rows = rows_of(res)
        assert rows.shape == (meta["prompt_tokens"] + meta["completion_tokens"] - 1, LAYERS, TOP_K)
        assert rows.min() >= 0 and rows.max() < EXPERTS
        expected, clear = teacher_routes(reference, prompt + out[:-1])
        same = (rows.sort(-1).values == expected.sort(-1).values).all(-1).all(-1)
        assert bool(same[clear].all()), f"positions whose routes differ: {(~same).nonzero().flatten().tolist()}"
    tail = await generate(moe_engine.url, sampling_params=sp, return_routed_experts=True, routed_experts_start_len=len(PROMPT))
    assert rows_of(tail).shape[0] == len(tail["output_ids"]) - 1, "start_len = prompt: the output positions fed back"


async def test_only_the_final_chunk_of_a_stream_carries_the_routes(moe_engine):
    chunks = []
    async with httpx.AsyncClient(timeout=120) as http, http.stream("POST", f"{moe_engine.url}/generate", json={
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_routed_experts": True, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                import json

                chunks.append(json.loads(line[6:]))
    assert all("routed_experts" not in c["meta_info"] for c in chunks[:-1])
    assert rows_of(chunks[-1]).shape[0] == len(PROMPT) + 6 - 1


async def test_bad_start_lengths_are_refused_with_sglangs_messages_and_the_flag_off_adds_nothing(moe_engine, tmp_path):
    async with httpx.AsyncClient(timeout=60) as http:
        for start, words in ((-1, "is lower than 0"), (len(PROMPT) + 1, "is higher than the number of input tokens")):
            r = await http.post(f"{moe_engine.url}/generate", json={"input_ids": PROMPT, "return_routed_experts": True,
                                                                     "routed_experts_start_len": start,
                                                                     "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    with start_engine(tmp_path, model=MOE, name="engine-moe-off") as off:
        res = await generate(off.url, sampling_params={"max_new_tokens": 3}, return_routed_experts=True)
        assert "routed_experts" not in res["meta_info"], "SGLang answers without routes when not started for them"


def test_a_dense_model_does_not_start_with_the_flag(tmp_path):
    with pytest.raises(Exception):  # noqa: B017 - the engine exits before /health answers
        with start_engine(tmp_path, "--enable-return-routed-experts", name="engine-dense"):
            pass
    log = next(tmp_path.glob("engine-dense-*.log")).read_text()
    assert "no top-k router" in log


async def test_an_aborted_running_request_reports_its_partial_rows(moe_engine):
    task = asyncio.create_task(generate(moe_engine.url, rid="moe-abort", return_routed_experts=True,
                                        sampling_params={"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}))
    async with moe_engine.client() as c:
        await wait_for(lambda: _tokens_over(c, len(PROMPT) + 4), 60, "the request to decode a few tokens")
    async with httpx.AsyncClient(timeout=60) as http:
        await http.post(f"{moe_engine.url}/abort_request", json={"rid": "moe-abort"})
    res = await task
    meta = res["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert rows_of(res).shape[0] == meta["prompt_tokens"] + meta["completion_tokens"] - 1


@pytest.mark.parametrize("how", ["abort_request", "pause"])
async def test_a_request_aborted_while_queued_answers_without_routes(moe_engine, how):
    """As SGLang answers an abort from its waiting queue (by rid, or a sync's ``abort`` pause): no
    ``routed_experts`` key at all."""
    long = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
    busy = [asyncio.create_task(generate(moe_engine.url, rid=f"moe-busy-{i}", return_routed_experts=True, sampling_params=long))
            for i in range(4)]  # the engine's --max-batch-size
    async with moe_engine.client() as c:
        async def counts(running: int, waiting: int) -> bool:
            now = (await c.loads())["loads"][0]
            return now["num_running_reqs"] == running and now["num_waiting_reqs"] == waiting

        await wait_for(lambda: counts(4, 0), 60, "four requests to fill the batch")
        queued = asyncio.create_task(generate(moe_engine.url, rid="moe-queued", return_routed_experts=True, sampling_params=long))
        await wait_for(lambda: counts(4, 1), 60, "the fifth request to wait in the queue")
    async with httpx.AsyncClient(timeout=60) as http:
        if how == "pause":
            await http.post(f"{moe_engine.url}/pause_generation", json={"mode": "abort"})
            await http.post(f"{moe_engine.url}/continue_generation", json={})
        else:
            await http.post(f"{moe_engine.url}/abort_request", json={"rid": "moe-queued"})
        res = await queued
        await http.post(f"{moe_engine.url}/abort_request", json={"abort_all": True})
    await asyncio.gather(*busy)
    meta = res["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 0
    assert "routed_experts" not in meta
