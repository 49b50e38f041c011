"""Everything asyncrl sends to an engine, checked against SGLang's own route table and request
classes for every release asyncrl supports, 0.5.15 to 0.5.23 (``sglang_source``).

The traffic is recorded, not re-typed: a recording proxy sits in front of a local_engine (one
emulating 0.5.23, one 0.5.18) while the product's own code runs against it:

- :class:`~asyncrl.engine_client.EngineClient`: every public call, with the options the product
  uses (generate and its stream, exact and all aborts, the three pause modes, flush, sessions,
  group calls, disk reload, version, info routes, health probes);
- the weight sync's engine side (:class:`~trainer_daemon.sync.direct.DirectEnginePublisher`,
  i.e. ``asyncrl.sync_control.engine_update``): two publishes (a new group, then a reused one);
- the rollout service's engine pool: routed generations and exact-rid aborts;
- an adapter sync's engine side (``asyncrl.sync_control.adapter_load`` as the sync agent runs
  it: staged over the tensors transport, then over the path transport, switched inside a pause
  with no weight session), a request naming the adapter, and a weights check.

A request the kit reports fails the test with the route, the release and the problem: a new
field SGLang would drop or reject, a route it does not have. Each release is checked against
the recording of the emulation that shares its request shapes: 0.5.21+ (weight sessions)
against 0.5.23's, 0.5.17-0.5.20 against 0.5.18's, 0.5.15-0.5.16 (``serialized_tensors``)
against 0.5.15's. The client calls no session route on a release without sessions.
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

EMULATED = {"0.5.23": "0.5.23", "0.5.18": "0.5.18", "0.5.15": "0.5.15"}
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj")
SESSION_ROUTES = {("POST", "/begin_weight_update"), ("POST", "/end_weight_update")}  # 0.5.21+ only
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
    await c.update_weight_version(17, abort_all_requests=False)
    model_dir = tmp_dir / "model"
    load_model("builtin:tiny").save_pretrained(model_dir, safe_serialization=True)
    await c.update_weights_from_disk(str(model_dir), weight_version=0)
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


async def drive_adapters(url: str, tmp_dir) -> None:
    """Two adapter syncs as the sync agent runs them (module docstring), then the adapter asked
    for by name and a weights check."""
    from asyncrl.sync_control.adapter_load import stage_adapter, switch_adapter
    from asyncrl.sync_control.engine_update import EngineUpdate, Member
    from asyncrl.sync_control.sequence import UpdateSteps, run_update
    from local_engine.lora import read_adapter_dir
    from tests.helpers.lora import make_adapter
    from trainer_daemon.policy.lora import AdapterSnapshot
    from trainer_daemon.sync.adapter import adapter_spec

    make_adapter(load_model("builtin:tiny"), tmp_dir / "adapter", seed=5)
    snapshot = AdapterSnapshot(*reversed(read_adapter_dir(str(tmp_dir / "adapter"))))

    async def one_sync(c: EngineClient, version: int, transport: str) -> None:
        spec = adapter_spec(snapshot, version, run_id="contract", transport=transport, adapter_dir=tmp_dir / "adapters")
        update = EngineUpdate([Member("engine", c)], control_timeout_s=TIMEOUT_S, total_buckets=1)
        staged = await stage_adapter(update, spec, run_id="contract", keep=version - 1, transport=transport, timeout_s=TIMEOUT_S)
        assert staged == {"engine"}, update.members[0].error
        load = lambda: switch_adapter(update, staged, spec.name, version, timeout_s=TIMEOUT_S)  # noqa: E731
        await run_update(update, "abort", 3, UpdateSteps(load=load, session=False))

    async with EngineClient(url, control_timeout_s=TIMEOUT_S, request_timeout_s=TIMEOUT_S) as c:
        for version, transport in ((1, "tensors"), (2, "path"), (3, "tensors")):  # the third unloads the first
            await one_sync(c, version, transport)
        await c.generate(PROMPT, {"max_new_tokens": 2, "temperature": 0.0}, extra={"lora_path": "contract-v3"})
        await c.check_weights(timeout_s=TIMEOUT_S)


async def _running(c: EngineClient) -> bool:
    return (await c.loads())["loads"][0]["num_running_reqs"] > 0


async def record(url: str, version: str, tmp) -> list:
    """Drive the product against ``url`` through a recording proxy; the recorded requests."""
    proxy = await RecordingProxy(url).start()
    try:
        async with EngineClient(proxy.url, request_timeout_s=TIMEOUT_S, control_timeout_s=TIMEOUT_S) as c:
            await drive_client(c, tmp)
            sessions = SglangCompat.of(version).sessions
            assert await c.begin_weight_update() is sessions
            if sessions:
                await c.end_weight_update()
        await drive_sync(proxy.url)
        await drive_pool(proxy.url)
        await drive_adapters(proxy.url, tmp)
        return list(proxy.requests)
    finally:
        await proxy.stop()


@pytest.fixture(scope="module")
def traffic(tmp_path_factory) -> dict[str, list]:
    """version → the requests recorded while the product talked to an engine emulating it."""
    out = {}
    for version, compat in EMULATED.items():
        tmp = tmp_path_factory.mktemp(f"traffic-{version}")
        with start_engine(tmp, "--sglang-compat", compat, *LORA_FLAGS, name=f"engine-{version}") as engine:
            out[version] = asyncio.run(record(engine.url, version, tmp))
    return out


def test_the_recording_covers_what_the_product_sends(traffic):
    seen = {(m, p) for m, p, _, _ in traffic["0.5.23"]}
    expected = {("POST", "/generate"), ("POST", "/abort_request"), ("POST", "/pause_generation"), ("POST", "/continue_generation"),
                ("GET", "/flush_cache"), ("POST", "/begin_weight_update"), ("POST", "/end_weight_update"),
                ("POST", "/init_weights_update_group"), ("POST", "/update_weights_from_distributed"),
                ("POST", "/destroy_weights_update_group"), ("POST", "/update_weights_from_disk"), ("POST", "/update_weight_version"),
                ("GET", "/model_info"), ("GET", "/server_info"), ("GET", "/v1/loads"), ("GET", "/health"), ("GET", "/health_generate"),
                ("POST", "/load_lora_adapter_from_tensors"), ("POST", "/load_lora_adapter"), ("POST", "/unload_lora_adapter"),
                ("GET", "/v1/models"), ("POST", "/weights_checker")}
    assert expected <= seen, expected - seen
    aborts = [b for m, p, _, b in traffic["0.5.23"] if p == "/abort_request"]
    assert {"rid": "rl-contract.0123abcd.t0.s0"} in aborts and {"rid": "contract-long-1"} in aborts
    assert not any(b.get("rid") == "rl-contract." for b in aborts), "no prefix aborts"


@pytest.mark.parametrize("version", kit.SUPPORTED_RELEASES)
def test_every_request_is_one_sglang_accepts(traffic, releases, version):
    """Every supported release, with the traffic recorded against the emulation that shares its
    request shapes (module docstring)."""
    compat = SglangCompat.of(version)
    recorded = traffic["0.5.23" if compat.sessions else "0.5.18" if compat.version >= "0.5.17" else "0.5.15"]
    problems = []
    for method, path, query, body in recorded:
        assert compat.sessions or (method, path) not in SESSION_ROUTES, f"{path} called on a release without sessions"
        issues = kit.check_request(version, method, path, body if body is not None else None, query or None)
        problems += [f"{method} {path} {body!r:.200}: {i}" for i in issues]
    assert not problems, "\n".join(problems)


def test_the_kit_would_catch_a_field_sglang_drops(traffic):
    """The check is not vacuous: the same recorded update body with one extra field fails."""
    method, path, query, body = next(r for r in traffic["0.5.23"] if r[1] == "/update_weights_from_distributed")
    assert kit.check_request("0.5.23", method, path, body, None) == []
    assert kit.check_request("0.5.23", method, path, {**body, "weights_consistent": True}, None)
