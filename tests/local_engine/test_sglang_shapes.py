"""What real SGLang showed that local_engine answered differently (issue 45 item 7, found by
tests/sglang/differential.py against a real 0.5.23 server), now pinned per release here:

- 401 is ``{"error": "Unauthorized"}``; an unknown route ``{"detail": "Not Found"}``;
- ``text`` with ``input_ids``: SGLang takes the ids; neither: ``{"error": {"message"}}``;
- ``sampling_params`` that do not decode (unknown key, wrong type): 0.5.22+'s contract gate
  answers ``{"error": "<string>"}``; values out of range ``{"error": {"message"}}``;
- ``meta_info`` carries ``cached_tokens_details``, ``dp_rank``, ``response_sent_to_client_ts``
  (and ``input_top_logprobs`` with ``top_logprobs_num``);
- ``/get_load`` (its own list shape) and ``/get_weight_version``'s deprecation 404 up to 0.5.20
  only; ``/model_info``'s serving fields from 0.5.21;
- ``/server_info`` reports ``max_loras_per_batch``; a start with ``--max-loaded-loras`` below it
  is refused with SGLang's message.
"""

from __future__ import annotations

import subprocess
import sys

import aiohttp
import pytest

from tests.helpers.processes import start_engine

KEY = "shape-key-0123456789"
IDS = [1, 5, 6, 7]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    with start_engine(d, "--sglang-compat", "0.5.23", api_key=KEY, name="new") as new, \
            start_engine(d, "--sglang-compat", "0.5.20", api_key=KEY, name="old") as old:
        yield {"0.5.23": new, "0.5.20": old}


async def _call(engine, method, path, body=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.request(method, engine.url + path, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def test_auth_and_unknown_routes(engines):
    for engine in engines.values():
        assert await _call(engine, "GET", "/model_info", key=None) == (401, {"error": "Unauthorized"})
        assert await _call(engine, "GET", "/model_info", key="wrong") == (401, {"error": "Unauthorized"})
        async with aiohttp.ClientSession() as s:  # the scheme is matched without case, as SGLang does
            async with s.get(engine.url + "/model_info", headers={"Authorization": f"bearer {KEY}"}) as r:
                assert r.status == 200
        assert await _call(engine, "GET", "/no_such_route") == (404, {"detail": "Not Found"})


async def test_text_with_ids_takes_the_ids_and_neither_is_refused(engines):
    greedy = {"max_new_tokens": 3, "temperature": 0}
    engine = engines["0.5.23"]
    s1, by_ids = await _call(engine, "POST", "/generate", {"input_ids": IDS, "sampling_params": greedy})
    s2, both = await _call(engine, "POST", "/generate", {"text": "something else entirely", "input_ids": IDS,
                                                        "sampling_params": greedy})
    assert s1 == s2 == 200 and both["output_ids"] == by_ids["output_ids"]
    assert both["meta_info"]["prompt_tokens"] == len(IDS)
    status, body = await _call(engine, "POST", "/generate", {"sampling_params": greedy})
    assert status == 400 and body == {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}


@pytest.mark.parametrize("params", [{"no_such": 1}, {"max_new_tokens": "x"}])
async def test_sampling_params_that_do_not_decode(engines, params):
    status, body = await _call(engines["0.5.23"], "POST", "/generate", {"input_ids": IDS, "sampling_params": params})
    assert status == 400 and isinstance(body["error"], str) and body["error"]  # the contract gate's string
    async with aiohttp.ClientSession() as s:  # before the gate: SGLang's TypeError escapes the route
        async with s.post(engines["0.5.20"].url + "/generate", json={"input_ids": IDS, "sampling_params": params},
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 500 and await r.text() == "Internal Server Error"


@pytest.mark.parametrize("params", [{"temperature": -1}, {"top_p": 0}, {"max_new_tokens": -1}, {"top_k": 0}])
async def test_sampling_params_out_of_range(engines, params):
    for engine in engines.values():
        status, body = await _call(engine, "POST", "/generate", {"input_ids": IDS, "sampling_params": params})
        assert status == 400 and isinstance(body["error"], dict) and body["error"]["message"]


async def test_meta_info_fields(engines):
    for engine in engines.values():
        _, out = await _call(engine, "POST", "/generate", {"input_ids": IDS, "return_logprob": True, "top_logprobs_num": 2,
                                                          "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        meta = out["meta_info"]
        assert meta["dp_rank"] is None and isinstance(meta["response_sent_to_client_ts"], float)
        assert meta["input_top_logprobs"] == [] and len(meta["output_top_logprobs"]) == 2
        assert meta["cached_tokens_details"] is None or meta["cached_tokens_details"]["device"] == meta["cached_tokens"]


async def test_release_routes(engines):
    new, old = engines["0.5.23"], engines["0.5.20"]
    assert (await _call(new, "GET", "/get_load"))[0] == 404
    status, loads = await _call(old, "GET", "/get_load")
    assert status == 200 and loads[0]["dp_rank"] == 0 and {"num_reqs", "num_tokens", "ts_tic"} <= set(loads[0])
    status, body = await _call(old, "GET", "/get_weight_version")
    assert status == 404 and "deprecated" in body["message"]
    assert await _call(new, "GET", "/get_weight_version") == (404, {"detail": "Not Found"})
    _, info_new = await _call(new, "GET", "/model_info")
    _, info_old = await _call(old, "GET", "/model_info")
    serving = {"served_model_name", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode"}
    assert serving <= set(info_new) and not serving & set(info_old)
    _, server = await _call(new, "GET", "/server_info")
    assert server["max_loras_per_batch"] == 8 and server["max_loaded_loras"] is None


def test_max_loaded_loras_below_max_loras_per_batch_is_refused_at_start():
    out = subprocess.run([sys.executable, "-m", "local_engine", "--port", "1", "--enable-lora", "--max-lora-rank", "4",
                          "--lora-target-modules", "q_proj", "--max-loaded-loras", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "max_loaded_loras should be greater than or equal to max_loras_per_batch" in out.stderr
