"""/generate against a real engine: logprobs equal teacher forcing, stop rules, streaming."""

from __future__ import annotations

import json

import aiohttp
import orjson
import pytest

from asyncrl.models import load_tokenizer
from tests.helpers.reference_model import teacher_forced_logprobs

PROMPT = [17, 301, 45, 922, 8, 77]
TOL = 1e-4


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 50},
        {"temperature": 1.3, "min_p": 0.05},
    ],
    ids=["greedy", "t1", "t0.7-topp-topk", "t1.3-minp"],
)
async def test_logprobs_match_teacher_forcing(client, ref_model, params):
    sp = {"max_new_tokens": 24, "ignore_eos": True, **params}
    await client.flush_cache(retries=3, interval_s=0.1)  # the shared engine's prefix cache may hold an aborted call's prompt
    res = await client.generate(PROMPT, sp)
    assert len(res.output_ids) == 24 and res.finish_reason.type == "length" and res.finish_reason.length == 24
    expected = teacher_forced_logprobs(ref_model, PROMPT, res.output_ids, params["temperature"])
    assert max(abs(a - b) for a, b in zip(res.logprobs, expected, strict=True)) < TOL
    assert res.prompt_tokens == len(PROMPT) and res.completion_tokens == 24 and res.cached_tokens == 0
    assert res.weight_version == 0  # "default": never synced
    # SGLang 0.5.19+ (the default emulates 0.5.23): a finished output carries its spans, here one
    assert [(w.version, w.start, w.end) for w in res.weight_versions] == [(0, 0, 24)]


async def test_greedy_is_argmax_of_reference(client, ref_model):
    from tests.helpers.reference_model import greedy_continuation

    res = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert res.output_ids == greedy_continuation(ref_model, PROMPT, 12)


async def test_concurrent_mixed_lengths_still_match_teacher_forcing(client, ref_model):
    import asyncio

    prompts = [PROMPT[: 2 + i] * (1 + i % 3) for i in range(6)]
    results = await asyncio.gather(*[
        client.generate(p, {"max_new_tokens": 10 + 3 * i, "temperature": 0.9, "ignore_eos": True}) for i, p in enumerate(prompts)
    ])
    for p, res in zip(prompts, results, strict=True):
        expected = teacher_forced_logprobs(ref_model, p, res.output_ids, 0.9)
        assert max(abs(a - b) for a, b in zip(res.logprobs, expected, strict=True)) < TOL


async def test_sampling_seed_is_honoured_only_under_deterministic_inference(tmp_path):
    """Issue 66 N8, SGLang's rule: with ``--enable-deterministic-inference`` a request samples
    from its ``sampling_seed`` (the same seed, the same tokens; another seed, others), and one
    without a seed is seeded with 42; without the flag the seed is ignored (SGLang builds no
    per-request seed then): two engines started alike answer the same request order alike
    whatever seeds the requests carry."""
    from tests.helpers.processes import start_engine

    sp = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    with start_engine(tmp_path, "--enable-deterministic-inference", name="engine-deterministic") as engine:
        async with engine.client() as c:
            a = await c.generate(PROMPT, sp)
            b = await c.generate(PROMPT, sp)
            other = await c.generate(PROMPT, {**sp, "sampling_seed": 99})
            unseeded = await c.generate(PROMPT, {k: v for k, v in sp.items() if k != "sampling_seed"})
            forty_two = await c.generate(PROMPT, {**sp, "sampling_seed": 42})
    assert a.output_ids == b.output_ids and a.output_ids != other.output_ids
    assert unseeded.output_ids == forty_two.output_ids
    answers = []
    for i, seeds in enumerate(((1234, 99), (5, 6))):
        with start_engine(tmp_path, name=f"engine-plain-{i}") as engine:
            async with engine.client() as c:
                answers.append([(await c.generate(PROMPT, {**sp, "sampling_seed": s})).output_ids for s in seeds])
    assert answers[0] == answers[1], "without the flag the seed changes nothing"


async def test_prompt_logprobs_with_logprob_start_len_zero(client, ref_model):
    res = await client.generate(PROMPT, {"max_new_tokens": 2, "temperature": 0}, extra={"logprob_start_len": 0})
    inputs = res.meta_info["input_token_logprobs"]
    assert [t[1] for t in inputs] == PROMPT and inputs[0][0] is None
    expected = teacher_forced_logprobs(ref_model, PROMPT[:1], PROMPT[1:])
    assert max(abs(t[0] - e) for t, e in zip(inputs[1:], expected, strict=True)) < TOL


async def test_stop_token_ids_and_eos(client):
    first = (await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})).output_ids
    res = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first[2]]})
    # ignore_eos off: stops at the first occurrence of the stop id (it may occur before index 2)
    cut = first.index(first[2])
    assert res.output_ids == first[: cut + 1]
    assert res.finish_reason.type == "stop" and res.finish_reason.matched == first[2]
    ignored = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first[2]], "ignore_eos": True})
    assert ignored.output_ids == first and ignored.finish_reason.type == "length"
    held = await client.generate(PROMPT, {"max_new_tokens": 8, "min_new_tokens": 8, "temperature": 0, "stop_token_ids": [first[0]]})
    assert len(held.output_ids) == 8 and first[0] not in held.output_ids


async def test_stop_string_trims_text_not_tokens(engine):
    tok = load_tokenizer("builtin:tiny")
    async with engine.client() as c:
        full = await c.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    text = tok.decode(full.output_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": stop}}
    async with aiohttp.ClientSession() as s, s.post(f"{engine.url}/generate", json=body) as r:
        out = await r.json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])
    assert tok.decode(out["output_ids"]).find(stop) >= 0  # the ids keep the stop string's tokens
    body["sampling_params"]["no_stop_trim"] = True
    async with aiohttp.ClientSession() as s, s.post(f"{engine.url}/generate", json=body) as r:
        kept = await r.json()
    assert stop in kept["text"]


async def test_text_input_and_text_in_logprobs(engine):
    tok = load_tokenizer("builtin:tiny")
    body = {"text": "hello world", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True,
            "return_text_in_logprobs": True, "rid": "text-1"}
    async with aiohttp.ClientSession() as s, s.put(f"{engine.url}/generate", json=body) as r:
        assert r.status == 200
        out = await r.json()
    meta = out["meta_info"]
    assert meta["id"] == "text-1" and meta["prompt_tokens"] == len(tok.encode("hello world"))
    assert [t[2] for t in meta["output_token_logprobs"]] == [tok.decode([t]) for t in out["output_ids"]]
    assert meta["e2e_latency"] > 0 and meta["completion_tokens"] == len(out["output_ids"])


async def test_stream_is_cumulative_and_ends_with_done(engine, ref_model):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "stream": True}
    chunks, done = [], False
    async with aiohttp.ClientSession() as s, s.post(f"{engine.url}/generate", json=body) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.strip()
            if not line:
                continue
            assert line.startswith(b"data: ")
            if line == b"data: [DONE]":
                done = True
                break
            chunks.append(orjson.loads(line[6:]))
    assert done and chunks
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    final = chunks[-1]
    lps = [t[0] for t in final["meta_info"]["output_token_logprobs"]]
    expected = teacher_forced_logprobs(ref_model, PROMPT, final["output_ids"], 1.0)
    assert max(abs(a - b) for a, b in zip(lps, expected, strict=True)) < TOL


async def test_top_logprobs(client):
    res = await client.generate(PROMPT, {"max_new_tokens": 3, "temperature": 0}, extra={"top_logprobs_num": 3})
    tops = res.meta_info["output_top_logprobs"]
    assert len(tops) == 3
    for top, tid, lp in zip(tops, res.output_ids, res.logprobs, strict=True):
        assert len(top) == 3 and top[0][1] == tid and abs(top[0][0] - lp) < 1e-6
        assert top[0][0] >= top[1][0] >= top[2][0]


async def test_max_new_tokens_zero(client):
    res = await client.generate(PROMPT, {"max_new_tokens": 0})
    assert res.output_ids == [] and res.finish_reason.type == "length" and res.finish_reason.length == 0


@pytest.mark.parametrize(("compat", "spans"), [("0.5.18", False), ("0.5.19", True)])
async def test_weight_version_spans_only_on_finished_outputs_from_0_5_19(tmp_path, compat, spans):
    """Read from the wheels (tests/contract/test_release_facts.py): finished outputs carry
    ``weight_versions`` from 0.5.19 on, stream chunks before the end never."""
    from asyncrl.engine_client import EngineClient
    from tests.helpers.processes import start_engine

    with start_engine(tmp_path, "--sglang-compat", compat, name=f"engine-{compat}") as engine:
        async with EngineClient(engine.url) as c:
            res = await c.generate(PROMPT, {"max_new_tokens": 6, "ignore_eos": True})
            assert [(w.version, w.start, w.end) for w in res.weight_versions] == ([(0, 0, 6)] if spans else [])
            async with aiohttp.ClientSession() as http, http.post(
                    f"{engine.url}/generate", json={"input_ids": PROMPT, "stream": True,
                                                    "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}) as resp:
                chunks = [json.loads(line[6:]) for line in (await resp.text()).splitlines() if line.startswith("data: {")]
    assert len(chunks) >= 2
    assert all("weight_versions" not in c["meta_info"] for c in chunks[:-1])
    assert ("weight_versions" in chunks[-1]["meta_info"]) is spans
