"""Every route answers malformed input with 400 (or 404/405) and a JSON error body, never 500.

Only bodies that cannot change the shared engine's state are sent here (no valid pause).
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from asyncrl.engine_client import EngineHTTPError, error_message
from tests.helpers.waiting import WAIT_S, wait_for
from tests.local_engine.helpers import load

J = orjson.dumps
OK_IDS = {"input_ids": [1, 2, 3]}

GENERATE_BAD = [
    b"not json",
    b"[1, 2]",
    b"",
    b'"a string"',
    J({}),
    J({"input_ids": []}),
    J({"text": ""}),
    J({"input_ids": [1, 99999]}),
    J({"input_ids": [-1]}),
    J({"input_ids": ["a"]}),
    J({"input_ids": [1.5]}),
    J({"input_ids": [True]}),
    J({"input_ids": [[1, 2], [3]]}),
    J({"text": ["a", "b"]}),
    J({**OK_IDS, "sampling_params": {"n": 2}}),
    J({**OK_IDS, "sampling_params": {"max_new_tokens": -1}}),
    J({**OK_IDS, "sampling_params": {"max_new_tokens": "ten"}}),
    J({**OK_IDS, "sampling_params": {"temperature": -0.5}}),
    J({**OK_IDS, "sampling_params": {"top_p": 0}}),
    J({**OK_IDS, "sampling_params": {"top_k": 0}}),
    J({**OK_IDS, "sampling_params": {"min_p": 2}}),
    J({**OK_IDS, "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}),
    J({**OK_IDS, "sampling_params": {"max_new_tokens": 5000}}),
    J({**OK_IDS, "sampling_params": {"repetition_penalty": 1.2}}),
    J({**OK_IDS, "sampling_params": {"max_new_tokens": 2, "bogus_key": 1}}),  # SGLang: SamplingParams(**...) fails
    J({**OK_IDS, "sampling_params": {"regex": "a+"}}),
    J({**OK_IDS, "sampling_params": {"stop": 5}}),
    J({**OK_IDS, "sampling_params": {"stop_token_ids": [-3]}}),
    J({**OK_IDS, "sampling_params": [{}]}),
    J({**OK_IDS, "sampling_params": "greedy"}),
    J({**OK_IDS, "stream": "yes"}),
    J({**OK_IDS, "return_logprob": 1}),
    J({**OK_IDS, "return_logprob": True, "logprob_start_len": 3}),
    J({**OK_IDS, "rid": ["a", "b"]}),
    J({**OK_IDS, "rid": 7}),
    J({**OK_IDS, "return_hidden_states": True}),
    J({**OK_IDS, "return_sampling_mask": [True]}),  # a batch
    J({**OK_IDS, "sampling_logprobs_mode": "support"}),  # without return_sampling_mask
    J({**OK_IDS, "return_sampling_mask": True, "sampling_logprobs_mode": "all"}),
    J({**OK_IDS, "lora_path": "adapter"}),
    J({**OK_IDS, "top_logprobs_num": 21}),
    b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}',
    b'{"input_ids": [1], "sampling_params": {"temperature": 1e999}}',
    b'{"input_ids": [1, 2',
    b"\xff\xfe\x00",
]

ADMIN_BAD = [
    ("/abort_request", b"nope"),
    ("/abort_request", J({"rid": 5})),
    ("/abort_request", J({"abort_all": "yes"})),
    ("/pause_generation", J({"mode": "sideways"})),
    ("/pause_generation", b"[]"),
    ("/continue_generation", J({"torch_empty_cache": "x"})),
    ("/init_weights_update_group", J({})),
    ("/init_weights_update_group", J({"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1, "world_size": 2})),
    ("/init_weights_update_group", J({"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 1})),
    ("/init_weights_update_group", J({"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 2, "world_size": 2})),
    ("/init_weights_update_group", J({"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2, "backend": "nccl"})),
    ("/update_weights_from_distributed", J({"names": ["a"], "dtypes": ["float32"]})),
    ("/update_weights_from_distributed", J({"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [2]]})),
    ("/update_weights_from_distributed", J({"names": [], "dtypes": [], "shapes": []})),
    ("/update_weights_from_distributed", J({"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]})),
    ("/update_weights_from_distributed", J({"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "load_format": "weird"})),
    ("/update_weights_from_distributed", J({"names": ["a", "a"], "dtypes": ["float32"] * 2, "shapes": [[1], [1]]})),
    ("/update_weights_from_distributed", J({"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]})),  # no group
    ("/update_weights_from_disk", J({})),
    ("/update_weights_from_disk", J({"model_path": 5})),
    ("/update_weights_from_disk", J({"model_path": "/nonexistent/dir"})),
    ("/update_weights_from_disk", J({"model_path": "x" * 5000})),  # a name too long: OSError, found by the OpenAPI fuzz
    ("/update_weights_from_disk", J({"model_path": "/tmp/a\u0000b"})),  # a NUL byte
    ("/update_weights_from_disk", J({"model_path": "/tmp", "load_format": "pt"})),
    ("/update_weight_version", J({})),
    ("/update_weight_version", J({"new_version": ""})),
    ("/update_weight_version", J({"new_version": 3})),  # SGLang refuses a number for its str field
    ("/update_weights_from_distributed", J({"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": 3})),
    ("/destroy_weights_update_group", J({"group_name": "nope"})),
    ("/update_weights_from_tensor", J({"serialized_named_tensors": ["x"]})),
]


async def _post(url: str, body: bytes, content_type: str = "application/json"):
    async with aiohttp.ClientSession() as s, s.post(url, data=body, headers={"Content-Type": content_type}) as r:
        return r.status, r.headers.get("content-type", ""), await r.read()


def _assert_error(status: int, ctype: str, raw: bytes, expected: int = 400):
    assert status == expected, raw[:300]
    assert ctype.startswith("application/json")
    body = orjson.loads(raw)
    assert error_message(body).strip()
    assert b"Traceback" not in raw


@pytest.mark.parametrize("body", GENERATE_BAD, ids=range(len(GENERATE_BAD)))
async def test_generate_rejects_malformed(engine, body):
    _assert_error(*await _post(f"{engine.url}/generate", body))


@pytest.mark.parametrize(("path", "body"), ADMIN_BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(ADMIN_BAD)])
async def test_admin_routes_reject_malformed(engine, path, body):
    _assert_error(*await _post(engine.url + path, body))
    assert (await _post(f"{engine.url}/generate", J({**OK_IDS, "sampling_params": {"max_new_tokens": 1}})))[0] == 200


async def test_text_plain_body_and_unknown_routes(engine):
    _assert_error(*await _post(f"{engine.url}/generate", b"hello", content_type="text/plain"))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{engine.url}/no_such_route") as r:
            _assert_error(r.status, r.headers["content-type"], await r.read(), expected=404)
        async with s.get(f"{engine.url}/generate") as r:
            _assert_error(r.status, r.headers["content-type"], await r.read(), expected=405)
        async with s.get(f"{engine.url}/get_weight_version") as r:
            _assert_error(r.status, r.headers["content-type"], await r.read(), expected=404)


async def test_duplicate_rid_in_flight_is_refused(client):
    long = asyncio.create_task(client.generate([1, 2], {"max_new_tokens": 3000, "ignore_eos": True}, rid="dup-rid"))
    await wait_for(lambda: _running(client), WAIT_S, "the first request with the rid to run")
    with pytest.raises(EngineHTTPError) as err:
        await client.generate([1, 2], {"max_new_tokens": 2}, rid="dup-rid")
    assert err.value.status == 400 and "duplicate" in err.value.message
    await client.abort("dup-rid")
    assert (await asyncio.wait_for(long, 30)).finish_reason.type == "abort"


async def _running(client) -> bool:
    return (await load(client))["num_running_reqs"] >= 1


async def test_oversized_body_is_refused_before_reading(engine):
    reader, writer = await asyncio.open_connection("127.0.0.1", engine.port)
    try:
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n{\"input_ids\": [")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 413")
    finally:
        writer.close()


@pytest.mark.parametrize(("path", "body"), [
    ("/update_weight_version", {"new_version": 3}),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": 3}),
])
async def test_a_number_for_a_weight_version_is_refused_as_by_sglang(engine, path, body):
    """SGLang validates its bodies in pydantic's lax mode after a JSON round trip: a number for a
    ``str`` field is a 400 (tests/contract/test_sglang_source.py pins that on the wheels);
    local_engine converted it (issue 35: a leniency that hid a client bug)."""
    status, ctype, raw = await _post(engine.url + path, J(body))
    _assert_error(status, ctype, raw)
    assert "weight version is a string" in error_message(orjson.loads(raw))
