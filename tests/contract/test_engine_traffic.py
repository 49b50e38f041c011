"""Everything asyncrl sends to an engine, checked against SGLang's own route table and request
classes for every release asyncrl supports, 0.5.15 to 0.5.23 (``sglang_source``).

The traffic is recorded, not re-typed: a recording proxy sits in front of a local_engine (one
emulating 0.5.23, one 0.5.18) while the product's own code runs against it:

- :class:`~asyncrl.engine_client.EngineClient`: every public call, with the options the product
  uses (generate and its stream, exact and all aborts, the three pause modes, flush, sessions,
  group calls, disk reload, version, info routes, health probes);
- the weight sync's engine side (:class:`~trainer_daemon.sync.direct.DirectEnginePublisher`,
  i.e. ``asyncrl.sync_control.engine_update``): two publishes (a new group, then a reused one);
- the rollout service's engine pool: routed generations and exact-rid aborts.

A request the kit reports fails the test with the route, the release and the problem: a new
field SGLang would drop or reject, a route it does not have. The only route allowed to be
missing is a weight-update session route on a release without sessions, where the product
relies on the 404 (``EngineClient.begin_weight_update`` returns False).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from asyncrl.engine_client import EngineClient, EngineHTTPError
from asyncrl.models import load_model
from local_engine.compat import SglangCompat
from rollout_service.engines.pool import EnginePool
from tests.contract import sglang_source as kit
from tests.helpers.processes import start_engine
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.waiting import wait_for
from trainer_daemon.sync.direct import DirectEnginePublisher

EMULATED = {"0.5.23": "0.5.23", "0.5.18": "0.5.18"}
SESSION_ROUTES = {("POST", "/begin_weight_update"), ("POST", "/end_weight_update")}
TIMEOUT_S = 60.0
PROMPT = [5, 17, 42, 99]


async def drive_client(c: EngineClient, tmp_dir) -> None:
    """Every EngineClient call the product makes, each with the options it uses."""
    await c.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "ignore_eos": True,
                              "stop_token_ids": [2], "no_stop_trim": True, "skip_special_tokens": False,
                              "spaces_between_special_tokens": False}, rid="contract-gen-1",
                     extra={"return_text_in_logprobs": True, "top_logprobs_num": 2, "logprob_start_len": -1})
    async for _ in c.generate_stream(PROMPT, {"max_new_tokens": 3, "temperature": 0.0}, rid="contract-stream-1"):
        pass
    long = asyncio.ensure_future(c.generate(PROMPT, {"max_new_tokens": 3000, "ignore_eos": True}, rid="contract-long-1"))
    await wait_for(lambda: _running(c), TIMEOUT_S, "the long generation to run")  # so the exact abort finds its rid
    await c.abort("contract-long-1")
    await c.abort(abort_all=True)
    await asyncio.wait_for(long, TIMEOUT_S)
    for mode in ("in_place", "retract", "abort"):
        await c.pause(mode)
        await c.resume()
    await c.flush_cache(retries=3, interval_s=0.1)
    await c.model_info()
    await c.server_info()
    await c.loads()
    await c.health(timeout_s=TIMEOUT_S)
    await c.health_generate(timeout_s=TIMEOUT_S)
    await c.alive()
    await c.update_weight_version("contract-v", abort_all_requests=False)
    model_dir = tmp_dir / "model"
    load_model("builtin:tiny").save_pretrained(model_dir, safe_serialization=True)
    await c.update_weights_from_disk(str(model_dir), weight_version="0")
    with contextlib.suppress(EngineHTTPError):
        await c.destroy_weights_update_group()


async def drive_sync(url: str) -> None:
    weights = {k: v.detach().clone() for k, v in load_model("builtin:tiny").state_dict().items()}
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.bfloat16)  # a bucket with two dtypes
    pub = DirectEnginePublisher([EngineClient(url)], master_address="127.0.0.1", bucket_bytes=256 * 1024,
                                group_timeout_s=TIMEOUT_S, broadcast_timeout_s=TIMEOUT_S, control_timeout_s=TIMEOUT_S)
    try:
        await pub.publish(1, weights)
        await pub.publish(2, weights)
    finally:
        await pub.close()


async def drive_pool(url: str) -> None:
    pool = EnginePool(control_timeout_s=TIMEOUT_S, request_timeout_s=TIMEOUT_S)
    pool.add(url)
    try:
        long = asyncio.ensure_future(pool.generate(None, PROMPT, {"max_new_tokens": 3000, "ignore_eos": True}, "rl-contract.0123abcd.t0.s0"))
        async with EngineClient(url, control_timeout_s=TIMEOUT_S) as probe:
            await wait_for(lambda: _running(probe), TIMEOUT_S, "the pool's generation to run")
        await pool.abort_inflight("rl-contract.")
        await asyncio.wait_for(long, TIMEOUT_S)
        await pool.check_once()
    finally:
        await pool.close()


async def _running(c: EngineClient) -> bool:
    return (await c.loads())["loads"][0]["num_running_reqs"] > 0


async def record(url: str, version: str, tmp) -> list:
    """Drive the product against ``url`` through a recording proxy; the recorded requests."""
    proxy = await RecordingProxy(url).start()
    try:
        async with EngineClient(proxy.url, request_timeout_s=TIMEOUT_S, control_timeout_s=TIMEOUT_S) as c:
            await drive_client(c, tmp)
            assert await c.begin_weight_update() is (version != "0.5.18")
            if version != "0.5.18":
                await c.end_weight_update()
        await drive_sync(proxy.url)
        await drive_pool(proxy.url)
        return list(proxy.requests)
    finally:
        await proxy.stop()


@pytest.fixture(scope="module")
def traffic(tmp_path_factory) -> dict[str, list]:
    """version → the requests recorded while the product talked to an engine emulating it."""
    out = {}
    for version, compat in EMULATED.items():
        tmp = tmp_path_factory.mktemp(f"traffic-{version}")
        with start_engine(tmp, "--sglang-compat", compat, name=f"engine-{version}") as engine:
            out[version] = asyncio.run(record(engine.url, version, tmp))
    return out


def test_the_recording_covers_what_the_product_sends(traffic):
    seen = {(m, p) for m, p, _, _ in traffic["0.5.23"]}
    expected = {("POST", "/generate"), ("POST", "/abort_request"), ("POST", "/pause_generation"), ("POST", "/continue_generation"),
                ("GET", "/flush_cache"), ("POST", "/begin_weight_update"), ("POST", "/end_weight_update"),
                ("POST", "/init_weights_update_group"), ("POST", "/update_weights_from_distributed"),
                ("POST", "/destroy_weights_update_group"), ("POST", "/update_weights_from_disk"), ("POST", "/update_weight_version"),
                ("GET", "/model_info"), ("GET", "/server_info"), ("GET", "/v1/loads"), ("GET", "/health"), ("GET", "/health_generate")}
    assert expected <= seen, expected - seen
    aborts = [b for m, p, _, b in traffic["0.5.23"] if p == "/abort_request"]
    assert {"rid": "rl-contract.0123abcd.t0.s0"} in aborts and {"rid": "contract-long-1"} in aborts
    assert not any(b.get("rid") == "rl-contract." for b in aborts), "no prefix aborts"


@pytest.mark.parametrize("version", kit.SUPPORTED_RELEASES)
def test_every_request_is_one_sglang_accepts(traffic, releases, version):
    """Every supported release, with the traffic recorded against the emulation of its side of
    the weight-update sessions (0.5.21+ have them: the 0.5.23 recording; older: the 0.5.18 one)."""
    sessions = SglangCompat.of(version).sessions
    recorded = traffic["0.5.23" if sessions else "0.5.18"]
    problems = []
    for method, path, query, body in recorded:
        issues = kit.check_request(version, method, path, body if body is not None else None, query or None)
        if not sessions and (method, path) in SESSION_ROUTES:
            assert all("no route" in i for i in issues), issues  # absent on purpose: the product handles the 404
            continue
        problems += [f"{method} {path} {body!r:.200}: {i}" for i in issues]
    assert not problems, "\n".join(problems)


def test_the_kit_would_catch_a_field_sglang_drops(traffic):
    """The check is not vacuous: the same recorded update body with one extra field fails."""
    method, path, query, body = next(r for r in traffic["0.5.23"] if r[1] == "/update_weights_from_distributed")
    assert kit.check_request("0.5.23", method, path, body, None) == []
    assert kit.check_request("0.5.23", method, path, {**body, "weights_consistent": True}, None)
