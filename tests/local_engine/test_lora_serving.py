"""LoRA adapters in local_engine: peft's numbers per row, and SGLang's routes and refusals.

The adapters are real peft adapters (``get_peft_model`` with random A and B, saved with
``save_pretrained``) on the engines' model; peft's own forward is the reference. The engine
process serves ``--enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj
--max-loaded-loras 2`` with an admin key; each test unloads what it loaded.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import pickle

import pytest
import torch

from asyncrl import failpoints
from asyncrl.engine_client import EngineHTTPError
from asyncrl.weight_sync.adapter import adapter_checksums, encode_adapter
from local_engine.adapter_payload import decode_tensors
from local_engine.lora import AdapterStore, read_adapter_dir
from local_engine.lora_compute import LoraLayers
from local_engine.runner import HFModelRunner
from local_engine.settings import EngineSettings, SettingsError
from tests.helpers.lora import make_adapter
from tests.helpers.processes import start_engine
from tests.helpers.reference_model import teacher_forced_logprobs
from tests.helpers.waiting import WAIT_S, wait_for

ADMIN_KEY = "lora-admin-key"
PROMPT = [31, 41, 59, 26, 53]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
STEP = "local_engine.step"
HOLD_S = 1.0  # how long a blocked call must stay blocked to count as held


@pytest.fixture(scope="module")
def adapters(ref_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: (make_adapter(ref_model, root / name, seed=i), root / name)
            for i, name in enumerate(("a", "b", "c"), start=1)}


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    """Its failpoints (``local_engine.step``) live in ``<its log dir>/failpoints``."""
    d = tmp_path_factory.mktemp("lora")
    (d / "failpoints").mkdir()
    with start_engine(d, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj",
                      "--max-loaded-loras", "2", "--max-loras-per-batch", "2", admin_api_key=ADMIN_KEY, name="lora-engine",
                      env={failpoints.ENV_DIR: str(d / "failpoints")}) as e:
        e.failpoints = d / "failpoints"
        yield e


@pytest.fixture
async def lclient(lora_engine):
    async with lora_engine.client() as c:
        yield c
        for card in (await c._call("GET", "/v1/models"))["data"][1:]:
            await c.unload_lora_adapter(card["id"])


# -- compute, in process ----------------------------------------------------------------
@torch.inference_mode()
def test_each_row_runs_its_own_adapter_as_peft_computes_it(ref_model, adapters):
    runner = HFModelRunner(copy.deepcopy(ref_model))
    runner.lora = LoraLayers(runner.model, ["q_proj", "v_proj"])
    store = AdapterStore(runner.lora, 8, ["q_proj", "v_proj"], None)
    for name in ("a", "b"):
        assert asyncio.run(store.load(name, str(adapters[name][1]), False))["success"]
    rows = [store.registry["a"].weights, None, store.registry["b"].weights]
    refs = [adapters["a"][0], ref_model, adapters["b"][0]]
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [7, 7, 2, 9]]
    contexts = [list(p) for p in prompts]
    logits = runner.prefill(prompts, [False] * 3, rows).last
    for step in range(4):
        for i, ctx in enumerate(contexts):
            want = refs[i](input_ids=torch.tensor([ctx])).logits[0, -1]
            assert torch.allclose(logits[i], want, atol=1e-4), (step, i)
        if step == 2:  # the middle row leaves: the others keep their adapters
            runner.keep([0, 2])
            contexts, refs, logits = [contexts[0], contexts[2]], [refs[0], refs[2]], logits[[0, 2]]
        nxt = [int(row.argmax()) for row in logits]
        for ctx, t in zip(contexts, nxt, strict=True):
            ctx.append(t)
        logits = runner.decode(nxt)
    # the adapters matter: a's row differs from the base model's
    assert not torch.allclose(adapters["a"][0](input_ids=torch.tensor([prompts[0]])).logits,
                              ref_model(input_ids=torch.tensor([prompts[0]])).logits, atol=1e-2)


def test_the_tensor_payload_is_read_only_as_tensors():
    tensors = {"x": torch.arange(4, dtype=torch.float32)}
    for old in (False, True):  # a plain pickle: every release 0.5.15-0.5.23 admits it (issue 46 item 4)
        assert torch.equal(decode_tensors(encode_adapter(tensors), old_protocols=old)["x"], tensors["x"])
    protocol2 = base64.b64encode(pickle.dumps(tensors, protocol=2)).decode()
    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(_codecs.encode\)"):
        decode_tensors(protocol2, old_protocols=False)  # SGLang before 0.5.21
    assert torch.equal(decode_tensors(protocol2, old_protocols=True)["x"], tensors["x"])

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(builtins.print\)"):
        decode_tensors(base64.b64encode(pickle.dumps({"x": Evil()})).decode(), old_protocols=True)


def test_lora_settings_are_checked_as_sglang_checks_them():
    with pytest.raises(SettingsError, match="you need to specify both --max-lora-rank and --lora-target-modules"):
        EngineSettings.from_argv(["--enable-lora", "--max-lora-rank", "8"])
    with pytest.raises(SettingsError, match="'all' is specified in --lora-target-modules, it should be the only"):
        EngineSettings.from_argv(["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "q_proj"])
    with pytest.raises(SettingsError, match="are not modules local_engine can adapt"):
        EngineSettings.from_argv(["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "lm_head"])
    s = EngineSettings.from_argv(["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"])
    assert EngineSettings.from_argv(s.to_argv()) == s and s.lora_target_modules == ["q_proj", "v_proj"]


# -- the routes, against an engine process --------------------------------------------------
async def test_an_adapter_from_a_path_serves_peft_logprobs_beside_the_base_model(lclient, adapters, ref_model):
    out = await lclient.load_lora_adapter("a", str(adapters["a"][1]))
    assert out["loaded_adapters"] == {"a": str(adapters["a"][1])}
    with_a, base = await asyncio.gather(lclient.generate(PROMPT, GREEDY, extra={"lora_path": "a"}), lclient.generate(PROMPT, GREEDY))
    assert with_a.output_ids != base.output_ids
    for res, model in ((with_a, adapters["a"][0]), (base, ref_model)):
        want = teacher_forced_logprobs(model, PROMPT, res.output_ids)
        assert res.logprobs == pytest.approx(want, abs=1e-4)
    models = await lclient._call("GET", "/v1/models")
    assert [(m["id"], m.get("parent")) for m in models["data"][1:]] == [("a", models["data"][0]["id"])]
    info = await lclient.server_info()
    assert (info["enable_lora"], info["max_lora_rank"], info["lora_target_modules"]) == (True, 8, ["q_proj", "v_proj"])


async def test_tensors_load_the_same_adapter_and_checksums_are_checked(lclient, adapters):
    config, tensors = read_adapter_dir(str(adapters["b"][1]))
    payload, sums = encode_adapter(tensors), adapter_checksums(tensors)
    wrong = dict(sums, **{next(iter(sums)): "0" * 64})
    with pytest.raises(EngineHTTPError, match=r"\[LORA-CHECK\] rank0 adapter sync MISMATCH of 16 expected: 1 value-diff"):
        await lclient.load_lora_adapter_from_tensors("b", config, payload, wrong)
    out = await lclient.load_lora_adapter_from_tensors("b", config, payload, sums)
    assert out["loaded_adapters"] == {"b": "__tensor__"}
    from_tensors = await lclient.generate(PROMPT, GREEDY, extra={"lora_path": "b"})
    await lclient.unload_lora_adapter("b")
    await lclient.load_lora_adapter("b", str(adapters["b"][1]))
    from_path = await lclient.generate(PROMPT, GREEDY, extra={"lora_path": "b"})
    assert from_tensors.output_ids == from_path.output_ids
    assert from_tensors.logprobs == pytest.approx(from_path.logprobs, abs=1e-6)


@pytest.mark.parametrize(("case", "message"), [
    ("duplicate", "Failed to load LoRA adapter a because it is already loaded"),
    ("rank", "LoRA adapter big with rank 16 is incompatible with the current LoRA memory pool configuration"),
    ("targets", "LoRA adapter mlp with rank 4 is incompatible with the current LoRA memory pool configuration"),
    ("missing", "is not a directory this engine can read"),
])
async def test_an_adapter_the_engine_cannot_serve_is_refused(lclient, adapters, ref_model, tmp_path, case, message):
    await lclient.load_lora_adapter("a", str(adapters["a"][1]))
    name, path = {"duplicate": ("a", adapters["a"][1]), "missing": ("gone", tmp_path / "gone")}.get(case, (None, None))
    if case == "rank":
        name, path = "big", tmp_path / "big"
        make_adapter(ref_model, path, rank=16)
    elif case == "targets":
        name, path = "mlp", tmp_path / "mlp"
        make_adapter(ref_model, path, targets=("q_proj", "gate_proj"))
    with pytest.raises(EngineHTTPError, match=message) as err:
        await lclient.load_lora_adapter(name, str(path))
    assert err.value.status == 400 and err.value.body["success"] is False
    assert (await lclient._call("GET", "/v1/models"))["data"][1]["id"] == "a"  # nothing else changed


async def test_requests_naming_no_loaded_adapter_are_refused(lclient, adapters, engine):
    with pytest.raises(EngineHTTPError, match="Got LoRA adapter that has never been loaded: nope") as err:
        await lclient.generate(PROMPT, GREEDY, extra={"lora_path": "nope"})
    assert err.value.status == 400
    with pytest.raises(EngineHTTPError, match="LoRA with name nope does not exist"):
        await lclient.unload_lora_adapter("nope")
    config, tensors = read_adapter_dir(str(adapters["c"][1]))
    await lclient.load_lora_adapter_from_tensors("c", config, encode_adapter(tensors))
    await lclient.unload_lora_adapter("c")
    with pytest.raises(EngineHTTPError, match="Failed to implicitly load LoRA adapter c"):
        await lclient.generate(PROMPT, GREEDY, extra={"lora_path": "c"})
    async with engine.client() as plain:  # an engine without --enable-lora
        with pytest.raises(EngineHTTPError, match="LoRA is not enabled. Please set `--enable-lora`"):
            await plain.load_lora_adapter("a", str(adapters["a"][1]))
        with pytest.raises(EngineHTTPError, match="LoRA adapter 'a' was requested, but LoRA is not enabled"):
            await plain.generate(PROMPT, GREEDY, extra={"lora_path": "a"})


async def test_an_unload_waits_for_the_requests_using_the_adapter(lora_engine, lclient, adapters):
    """The request is held mid-way by the ``local_engine.step`` failpoint while the unload is
    asked, so the unload always meets it running."""
    await lclient.load_lora_adapter("a", str(adapters["a"][1]))
    points = lora_engine.failpoints
    (points / f"{STEP}.arm").touch()
    try:
        running = asyncio.ensure_future(lclient.generate(PROMPT, GREEDY, extra={"lora_path": "a"}))
        await wait_for(lambda: bool(failpoints.reached(points, STEP)), WAIT_S, "the engine to hold the generation")
        unload = asyncio.ensure_future(lclient.unload_lora_adapter("a"))
        await asyncio.sleep(HOLD_S)  # not a wait for a state: room for a wrong engine to unload under the request
        assert not unload.done() and not running.done()
        assert [m["id"] for m in (await lclient._call("GET", "/v1/models"))["data"][1:]] == []  # gone for new requests
    finally:
        (points / f"{STEP}.arm").unlink()
        (points / f"{STEP}.release").touch()
    res = await asyncio.wait_for(running, WAIT_S)
    assert len(res.output_ids) == GREEDY["max_new_tokens"] and res.finish_reason.type == "length"
    assert (await asyncio.wait_for(unload, WAIT_S))["loaded_adapters"] == {}
    for f in points.iterdir():
        f.unlink()


async def test_a_load_over_max_loaded_loras_evicts_the_least_recently_used(lclient, adapters):
    for name in ("a", "b"):
        await lclient.load_lora_adapter(name, str(adapters[name][1]))
    await lclient.generate(PROMPT, GREEDY, extra={"lora_path": "a"})  # b is now the least recently used
    out = await lclient.load_lora_adapter("c", str(adapters["c"][1]))
    assert set(out["loaded_adapters"]) == {"a", "c"}
    res = await lclient.generate(PROMPT, GREEDY, extra={"lora_path": "b"})  # reloaded from its path
    assert len(res.output_ids) == GREEDY["max_new_tokens"]
    assert {m["id"] for m in (await lclient._call("GET", "/v1/models"))["data"][1:]} == {"b", "c"}


@pytest.mark.parametrize("config", [
    {"r": 0, "lora_alpha": 8, "target_modules": ["q_proj"]},
    {"r": "4", "lora_alpha": 8, "target_modules": ["q_proj"]},
    {"r": 4, "lora_alpha": None, "target_modules": ["q_proj"]},
    {"r": 4, "lora_alpha": 8, "target_modules": 5},
    {"r": 4, "lora_alpha": 8},
])
async def test_a_hostile_adapter_config_is_a_400_naming_it(lclient, adapters, config):
    _, tensors = read_adapter_dir(str(adapters["a"][1]))
    with pytest.raises(EngineHTTPError) as err:
        await lclient.load_lora_adapter_from_tensors("hostile", config, encode_adapter(tensors))
    assert err.value.status == 400 and err.value.body["success"] is False and err.value.body["error_message"]
    assert await lclient.lora_adapters() == []
