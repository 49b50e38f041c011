"""Weight updates: a separate trainer process broadcasts through gloo; disk reloads; failures.

The engine here (SGLang 0.5.23 behaviour, the default) runs with an api key and an admin key
(the trainer holds both, as the sync agent does: from 0.5.21 the client reads the release
from ``/server_info``, a normal route that SGLang opens to the api key only), and ``--weight-sync-timeout-s 60``. Each test starts from
the base weights loaded from disk, with no weight-update session or group left open, so the
tests do not depend on each other's order. Like SGLang, the engine never says whether its
weights are consistent: a failed push leaves it serving a mix, and knowing that is the caller's
job (tests/sync).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import sys
from pathlib import Path

import aiohttp
import pytest

from asyncrl.engine_client import EngineHTTPError
from asyncrl.weight_sync.checksum import canonical, weights_checksum
from tests.helpers.processes import start_engine
from tests.helpers.reference_model import greedy_continuation, teacher_forced_logprobs
from tests.helpers.waiting import WAIT_S, wait_for
from tests.local_engine.weight_trainer import perturb

BASE = 100  # the label the base weights are loaded under (an engine's weight versions are numbers to asyncrl)

REPO = Path(__file__).resolve().parents[2]
TRAINER_TIMEOUT_S = 180.0
API_KEY, ADMIN_KEY = "data-plane-key", "admin-plane-key"
PROMPT = [31, 41, 59, 26, 53]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def wengine(tmp_path_factory):
    with start_engine(tmp_path_factory.mktemp("weights"), "--weight-sync-timeout-s", "60",
                        api_key=API_KEY, admin_api_key=ADMIN_KEY, name="weights-engine") as e:
        yield e


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, ref_model) -> Path:
    path = tmp_path_factory.mktemp("base-weights")
    ref_model.save_pretrained(path)
    return path


@pytest.fixture
async def wclient(wengine, base_dir):
    async with wengine.client() as c:
        with contextlib.suppress(EngineHTTPError):  # a failed earlier test may have left its group
            await c.destroy_weights_update_group()
        with contextlib.suppress(EngineHTTPError):  # ... or its weight-update session
            await c.end_weight_update()
        await c.update_weights_from_disk(str(base_dir), weight_version=BASE)
        yield c
        await c.resume()


async def run_trainer(engine, *args: str, expect_exit: int = 0) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.local_engine.weight_trainer", "--engine-url", engine.url, "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TRAINER_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == expect_exit, err.decode()[-3000:]
    lines = out.decode().strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


async def assert_serves(client, model, version: int):
    """The engine serves ``model`` as ``version`` — after the cache flush that follows every update
    in the sync sequence (the updates here send ``flush_cache: false`` as the product does; an
    aborted call's KV of the old weights would otherwise serve this prompt's prefix)."""
    await client.flush_cache(retries=3, interval_s=0.1)
    res = await client.generate(PROMPT, GREEDY)
    assert res.output_ids == greedy_continuation(model, PROMPT, GREEDY["max_new_tokens"])
    expected = teacher_forced_logprobs(model, PROMPT, res.output_ids)
    assert max(abs(a - b) for a, b in zip(res.logprobs, expected, strict=True)) < 1e-4
    assert res.weight_version == version
    assert (await client.model_info())["weight_version"] == str(version)  # the engine's own label
    # the engine's own checksum of what it holds equals the checksum of the model's weights
    named = canonical({k: v for k, v in model.state_dict().items() if v.is_floating_point()})
    got = await client.weights_checksum()
    assert got == {"weight_version": str(version), "checksum": weights_checksum(named), "parameters": len(named)}


@pytest.mark.parametrize("layout", [["--bucket-bytes", "200000"], ["--no-flatten", "--bucket-bytes", "1000000"]], ids=["flattened", "per-tensor"])
async def test_distributed_update_from_trainer_process(wengine, wclient, ref_model, layout):
    await assert_serves(wclient, ref_model, BASE)
    result = await run_trainer(wengine, "--version", "1", "--perturb-seed", "7", *layout)
    assert result["ok"], result
    assert result["buckets"] >= 2
    await assert_serves(wclient, perturb(copy.deepcopy(ref_model), 7), 1)
    assert "weights_consistent" not in await wclient.model_info()


async def test_update_waits_for_in_flight_generation_when_not_paused(wengine, wclient, ref_model, tmp_path):
    go = tmp_path / "go"
    trainer = asyncio.create_task(run_trainer(wengine, "--version", "2", "--perturb-seed", "11", "--pause", "none",
                                              "--wait-file", str(go)))
    await wait_for(lambda: _has_group(wclient), 120, "the trainer's group")
    long = asyncio.create_task(wclient.generate(PROMPT, {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}, rid="lock-long"))
    await wait_for(lambda: _generating(wclient), WAIT_S, "the long generation to run")
    go.touch()  # now the trainer opens its session and updates: both wait for the writer lock
    await wait_for(lambda: _writers_waiting(wclient), 60, "the weight update to wait for the writer lock")
    assert not long.done(), long.result().finish_reason
    assert (await wclient.model_info())["weight_version"] == str(BASE)
    await wclient.abort("lock-long")
    res = await asyncio.wait_for(long, 30)
    result = await asyncio.wait_for(trainer, TRAINER_TIMEOUT_S)
    assert result["ok"], result
    assert res.finish_reason.type == "abort" and [w.version for w in res.weight_versions] == [BASE]
    expected = teacher_forced_logprobs(ref_model, PROMPT, res.output_ids)  # all tokens from the old weights
    assert max(abs(a - b) for a, b in zip(res.logprobs, expected, strict=True)) < 1e-4
    await assert_serves(wclient, perturb(copy.deepcopy(ref_model), 11), 2)


async def _has_group(client) -> bool:
    return bool((await client.server_info())["internal_states"][0]["weight_update_groups"])


async def _generating(client) -> bool:
    return (await client.loads())["loads"][0]["num_running_reqs"] > 0


async def _writers_waiting(client) -> bool:
    return (await client.server_info())["internal_states"][0]["weight_writers_waiting"] > 0


async def test_failure_mid_push_leaves_mixed_weights_served_silently_as_sglang_does(wengine, wclient, ref_model, base_dir):
    result = await run_trainer(wengine, "--version", "3", "--perturb-seed", "5", "--bucket-bytes", "100000", "--corrupt-bucket", "1")
    assert not result["ok"] and result["buckets"] == 1 and "shape mismatch" in result["error"]
    assert "partially updated" in result["error"]
    assert await wclient.health() is True  # SGLang has no consistency flag: it keeps serving
    info = await wclient.model_info()
    assert "weights_consistent" not in info and info["weight_version"] == "3"  # bucket 0 succeeded and set it
    res = await wclient.generate(PROMPT, GREEDY)
    old = teacher_forced_logprobs(ref_model, PROMPT, res.output_ids)
    new = teacher_forced_logprobs(perturb(copy.deepcopy(ref_model), 5), PROMPT, res.output_ids)
    assert max(abs(a - b) for a, b in zip(res.logprobs, old, strict=True)) > 1e-3, "bucket 0's parameters changed"
    assert max(abs(a - b) for a, b in zip(res.logprobs, new, strict=True)) > 1e-3, "the later buckets did not arrive"
    await wclient.update_weights_from_disk(str(base_dir), weight_version=BASE)
    await assert_serves(wclient, ref_model, BASE)


async def test_trainer_crash_mid_broadcast_fails_the_update_and_keeps_serving(wengine, wclient, ref_model, base_dir):
    before = await _failed_updates(wengine)
    await run_trainer(wengine, "--version", "8", "--bucket-bytes", "100000", "--pause", "none", "--die-at-bucket", "2", expect_exit=3)
    await wait_for(lambda: _failed_more(wengine, before), 60, "the engine to notice the dead sender")
    info = await wclient.model_info()
    assert "weights_consistent" not in info and info["weight_version"] == "8"  # buckets 0 and 1 landed
    state = (await wclient.server_info())["internal_states"][0]
    assert state["weight_update_groups"] == ["weight_update_group"] and state["weight_update_session"] is True
    assert await wclient.health() is True
    await wclient.destroy_weights_update_group()
    await wclient.end_weight_update()
    await wclient.update_weights_from_disk(str(base_dir), weight_version=BASE)
    await assert_serves(wclient, ref_model, BASE)


async def _failed_updates(engine) -> float:
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("local_engine_weight_updates_total{") and 'kind="distributed"' in line and 'result="failed"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _failed_more(engine, before: float):
    async def check() -> bool:
        return await _failed_updates(engine) > before

    return check


async def test_refused_first_bucket_leaves_this_engines_weights_unchanged(wengine, wclient, ref_model):
    result = await run_trainer(wengine, "--version", "4", "--corrupt-bucket", "0", "--bucket-bytes", "100000")
    assert not result["ok"] and result["buckets"] == 0
    assert await wclient.health() is True
    await assert_serves(wclient, ref_model, BASE)


async def test_disk_update_and_its_failures(wclient, ref_model, tmp_path):
    other = perturb(copy.deepcopy(ref_model), 23)
    other.save_pretrained(tmp_path / "v5")
    out = await wclient.update_weights_from_disk(str(tmp_path / "v5"), weight_version=5)
    assert out["success"] is True and out["num_paused_requests"] == 0
    await assert_serves(wclient, other, 5)
    for bad_path, needle in ((tmp_path / "missing", "not a directory"), (tmp_path, "no *.safetensors")):
        with pytest.raises(EngineHTTPError) as err:
            await wclient.update_weights_from_disk(str(bad_path), weight_version=6)
        assert err.value.status == 400 and needle in err.value.message
    from safetensors.torch import save_file

    wrong = {k: v.clone() for k, v in other.state_dict().items() if k != "lm_head.weight"}
    first = next(iter(wrong))
    wrong[first] = wrong[first].flatten()[:-1].clone()
    (tmp_path / "wrong").mkdir()
    save_file(wrong, str(tmp_path / "wrong" / "model.safetensors"))
    with pytest.raises(EngineHTTPError) as err:
        await wclient.update_weights_from_disk(str(tmp_path / "wrong"), weight_version=6)
    assert "shape mismatch" in err.value.message
    nan = {k: v.clone() for k, v in other.state_dict().items() if k != "lm_head.weight"}
    nan["model.norm.weight"][0] = float("nan")
    (tmp_path / "nan").mkdir()
    save_file(nan, str(tmp_path / "nan" / "model.safetensors"))
    with pytest.raises(EngineHTTPError) as err:
        await wclient.update_weights_from_disk(str(tmp_path / "nan"), weight_version=6)
    assert "non-finite" in err.value.message and "model.norm.weight" in err.value.message
    await assert_serves(wclient, other, 5)  # nothing changed


async def test_update_weight_version_route(wclient):
    out = await wclient.update_weight_version(7, abort_all_requests=False)
    assert out == {"success": True, "message": "Weight version updated to 7", "new_version": "7"}  # a string on the wire
    assert await wclient.weight_version() == 7


@pytest.mark.parametrize(
    ("path", "key", "status"),
    [
        ("/model_info", None, 401),
        ("/model_info", API_KEY, 200),
        ("/model_info", ADMIN_KEY, 401),
        ("/health", None, 200),
        ("/metrics", None, 200),
        ("/flush_cache", API_KEY, 401),
        ("/flush_cache", ADMIN_KEY, 200),
        ("/server_info", API_KEY, 200),
    ],
)
async def test_auth_levels(wengine, path, key, status):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.get(wengine.url + path, headers=headers) as r:
        assert r.status == status
        if status == 401:
            assert await r.json() == {"error": "Unauthorized"}  # SGLang's body (tests/sglang/test_differential.py)
        if path == "/server_info" and status == 200:
            text = await r.text()
            assert API_KEY not in text and ADMIN_KEY not in text
