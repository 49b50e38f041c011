"""Tests of the SGLang contract kit itself, against the real sources of both pinned versions."""

import ast
import subprocess
import threading
import time
import zipfile
from pathlib import Path
from typing import Annotated

import pytest
from fastapi import Body, FastAPI
from fastapi.testclient import TestClient

from tests.contract import sglang_source as kit
from tests.contract import sglang_wheel

KNOWN_ROUTES = [("POST", "/generate"), ("POST", "/update_weights_from_distributed"), ("GET", "/model_info"),
                ("GET", "/server_info"), ("POST", "/abort_request"), ("POST", "/pause_generation"),
                ("POST", "/continue_generation")]
HAS_BEGIN_WEIGHT_UPDATE = {"0.5.18": False, "0.5.23": True}
UPDATE = {"names": ["model.embed.weight", "lm_head.weight"], "dtypes": ["bfloat16", "bfloat16"],
          "shapes": [[8, 4], [8, 4]], "group_name": "asyncrl", "weight_version": "3",
          "load_format": "flattened_bucket", "flush_cache": False}
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.5},
            "return_logprob": True, "rid": "r-1"}


def test_versions_are_pinned():
    assert kit.PINNED == ("0.5.18", "0.5.23")


def test_known_routes_exist(sglang_version):
    assert set(KNOWN_ROUTES) <= kit.routes(sglang_version)
    for method, path in KNOWN_ROUTES:
        assert not [p for p in kit.check_request(sglang_version, method, path, {}) if p.startswith("no route")]


def test_begin_weight_update_exists_only_in_0_5_23(sglang_version):
    present = HAS_BEGIN_WEIGHT_UPDATE[sglang_version]
    assert (("POST", "/begin_weight_update") in kit.routes(sglang_version)) is present
    assert (("POST", "/end_weight_update") in kit.routes(sglang_version)) is present
    assert ("BeginWeightUpdateReqInput" in kit.request_classes(sglang_version)) is present
    problems = kit.check_request(sglang_version, "POST", "/begin_weight_update", {})
    assert problems == ([] if present else [f"no route POST /begin_weight_update in sglang {sglang_version}"])


def test_made_up_route_and_wrong_method_are_reported(sglang_version):
    v = sglang_version
    assert kit.check_request(v, "POST", "/made_up_route", {}) == [f"no route POST /made_up_route in sglang {v}"]
    assert kit.check_request(v, "GET", "/update_weights_from_distributed") == [
        f"no route GET /update_weights_from_distributed in sglang {v}"]


def test_routes_include_routers_env_defaults_and_if_blocks(sglang_version):
    found = kit.routes(sglang_version)
    assert ("GET", "/v1/loads") in found  # declared on an APIRouter passed to app.include_router
    assert ("POST", "/vertex_generate") in found  # os.environ.get("AIP_PREDICT_ROUTE", "/vertex_generate")
    assert ("POST", "/dumper/{method}") in found  # inside an `if` block
    assert {("GET", "/flush_cache"), ("POST", "/flush_cache"), ("PUT", "/generate")} <= found  # api_route methods
    assert not kit.check_request(sglang_version, "GET", "/v1/models/org/model-name")  # {model:path}


def test_route_bodies_match_handler_signatures(sglang_version):
    handlers, classes = kit.handlers(sglang_version), kit.request_classes(sglang_version)
    for path, cls in kit.ROUTE_BODIES.items():
        served = [h for (m, p), h in handlers.items() if p == path]
        # /weights_checker takes no body as {} (``Optional[CheckWeightsReqInput] = None``)
        required = path != "/weights_checker"
        assert all(h.body == (cls,) and h.body_required == required for h in served), (path, served)
        assert bool(served) == (cls in classes), path


def test_classes_keep_the_source_fields(sglang_version):
    """The executed classes have exactly the annotated fields of io_struct.py (read independently)."""
    tree = ast.parse((kit.source_dir(sglang_version) / kit.IO_STRUCT).read_text())
    defs = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def source_fields(name: str) -> list[str]:
        node = defs[name]
        own = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]
        bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in defs]
        return [f for b in bases for f in source_fields(b)] + own

    for name, cls in kit.request_classes(sglang_version).items():
        assert sorted(kit._fields(cls)) == sorted(source_fields(name)), name
    distributed = kit.request_classes(sglang_version)["UpdateWeightsFromDistributedReqInput"]
    assert distributed(names=[], dtypes=[], shapes=[]).group_name == "weight_update_group"


def test_update_weights_from_distributed_bodies(sglang_version):
    v, path = sglang_version, "/update_weights_from_distributed"
    assert kit.check_request(v, "POST", path, UPDATE) == []
    assert kit.check_request(v, "POST", path, {**UPDATE, "weights_consistent": True}) == [
        f"field weights_consistent is not a field of UpdateWeightsFromDistributedReqInput in sglang {v} "
        "(it would be ignored)"]
    [shapes] = kit.check_request(v, "POST", path, {**UPDATE, "shapes": "x"})
    assert shapes.startswith("field shapes='x' is not a valid List[List[int]]")
    missing = {k: val for k, val in UPDATE.items() if k != "names"}
    assert kit.check_request(v, "POST", path, missing) == [
        f"field names is required by UpdateWeightsFromDistributedReqInput in sglang {v} but missing"]
    assert kit.check_request(v, "POST", path, [UPDATE])[0].startswith("body must be a JSON object")
    assert kit.check_request(v, "POST", path)[0].startswith(f"POST {path} requires a JSON body")


def test_generate_bodies(sglang_version):
    v = sglang_version
    gated = kit.generate_contract(v) is not None  # 0.5.23: its decoder reports what the dataclass parse does too

    def dataclass_problems(body) -> list[str]:
        return [p for p in kit.check_request(v, "POST", "/generate", body) if "contract gate" not in p]

    def gate_problems(body) -> list[str]:
        return [p for p in kit.check_request(v, "POST", "/generate", body) if "contract gate" in p]

    assert kit.check_request(v, "POST", "/generate", GENERATE) == []
    assert kit.check_request(v, "PUT", "/generate", GENERATE) == []
    foo = {**GENERATE, "sampling_params": {"max_new_tokens": 4, "foo": 1}}
    assert dataclass_problems(foo) == [
        f"sampling param foo is not an argument of SamplingParams in sglang {v} (TypeError, HTTP 400)"]
    assert [("unknown field `foo`" in p) for p in gate_problems(foo)] == ([True] if gated else [])
    batch = {**GENERATE, "input_ids": [[1], [2]], "rid": ["a", "b"], "sampling_params": [{"n": 1}, {"bar": 2}]}
    assert [p.split()[2] for p in dataclass_problems(batch)] == ["bar"]
    # pydantic (lax python mode, as FastAPI runs it) has no int -> str coercion: SGLang rejects it.
    [rid] = dataclass_problems({**GENERATE, "rid": 5})
    assert rid.startswith("field rid=5 is not a valid Optional[Union[str, List[str]]] for GenerateReqInput")
    [ids] = dataclass_problems({**GENERATE, "input_ids": ["a"]})
    assert "elements must be int or list" in ids  # SGLang's own PlainValidator ran
    assert {"max_new_tokens", "temperature", "top_p", "stop", "n"} <= kit.sampling_param_names(v)


def test_abort_request_bodies(sglang_version):
    v = sglang_version
    assert kit.check_request(v, "POST", "/abort_request", {"rid": "x"}) == []
    assert kit.check_request(v, "POST", "/abort_request", {"abort_all": True}) == []
    assert kit.check_request(v, "POST", "/abort_request", {"rid": "", "abort_all": True}) == []
    assert len(kit.check_request(v, "POST", "/abort_request", {"rid": ["x"]})) == 1


def test_bodyless_routes_and_query(sglang_version):
    v = sglang_version
    for path in ("/model_info", "/server_info", "/health", "/health_generate", "/v1/loads", "/flush_cache"):
        assert kit.check_request(v, "GET", path) == [], path
    assert kit.check_request(v, "GET", "/flush_cache", query={"timeout": 5}) == []
    assert len(kit.check_request(v, "GET", "/flush_cache", query={"timeout": -1})) == 1  # Query(ge=0.0)
    assert len(kit.check_request(v, "GET", "/flush_cache", query={"timeot": 5})) == 1
    assert kit.check_request(v, "GET", "/model_info", {"x": 1}) == [
        f"GET /model_info takes no body in sglang {v} (it would be ignored)"]


@pytest.mark.parametrize(("path", "body"), [
    ("/update_weights_from_distributed", UPDATE),
    ("/update_weights_from_distributed", {**UPDATE, "flush_cache": "false", "shapes": [["8", 4.0]]}),
    ("/update_weights_from_distributed", {**UPDATE, "weight_version": 3}),
    ("/update_weights_from_distributed", {**UPDATE, "names": "lm_head.weight"}),
    ("/update_weights_from_distributed", {"dtypes": [], "shapes": []}),
    ("/init_weights_update_group", {"master_address": "h", "master_port": "29500", "rank_offset": 1, "world_size": 2}),
    ("/init_weights_update_group", {"master_address": "h", "master_port": "x", "rank_offset": 1.5, "world_size": 2}),
    ("/pause_generation", {"mode": "in_place"}),
    ("/pause_generation", {"mode": "bogus"}),
    ("/generate", GENERATE),
    ("/generate", {**GENERATE, "rid": 5}),
    ("/generate", {**GENERATE, "return_logprob": "yes", "stream": [True]}),
])
def test_kit_agrees_with_fastapi(sglang_version, path, body):
    """Served by FastAPI the way SGLang declares the handler, the executed class rejects (422)
    exactly the bodies the kit reports (ignored fields and sampling keys aside)."""
    cls = kit.request_classes(sglang_version)[kit.ROUTE_BODIES[path]]
    app = FastAPI()

    @app.post("/struct")
    async def struct(obj: Annotated[cls, Body()]):
        return {}

    @app.post("/dataclass")
    async def dataclass(obj: cls):
        return {}

    route = "/dataclass" if path == "/generate" else "/struct"
    status = TestClient(app).post(route, json=body).status_code
    problems = [p for p in kit.check_request(sglang_version, "POST", path, body) if "ignored" not in p]
    assert (status == 422) == bool(problems), (status, problems)


def test_cached_source_dir_is_fast_and_runs_no_pip(sglang_version, monkeypatch):
    first = kit.source_dir(sglang_version)

    def no_pip(*args, **kwargs):
        raise AssertionError(f"pip ran for a cached version: {args}")

    monkeypatch.setattr(subprocess, "run", no_pip)
    start = time.monotonic()
    assert kit.source_dir(sglang_version) == first
    assert time.monotonic() - start < 1.0
    assert (first / kit.HTTP_SERVER).is_file() and (first / kit.IO_STRUCT).is_file()
    assert not list(first.rglob("*.whl"))


def test_download_failure_says_what_and_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path))
    error = "ERROR: Could not find a version that satisfies the requirement sglang==0.5.18"
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", error))
    with pytest.raises(kit.SGLangSourceError) as raised:
        kit.source_dir("0.5.18")
    message = str(raised.value)
    assert "pip download --no-deps --no-build-isolation" in message and error in message
    assert "PyPI" in message and "ASYNCRL_CACHE_DIR" in message
    assert not (kit.cache_dir() / "0.5.18").exists()


def test_concurrent_first_calls_download_once(tmp_path, monkeypatch):
    """Two callers at once: one download under the lock, the other waits and reuses it."""
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_download(version: str, dest: Path) -> Path:
        calls.append(version)
        time.sleep(0.5)  # not a wait for a state: a slow download, room for the second caller to race it
        dest.mkdir(parents=True)
        wheel = dest / f"sglang-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            for member in [kit.HTTP_SERVER, kit.IO_STRUCT, kit.SAMPLING_PARAMS, kit.SERVER_ARGS, kit.FUNCTION_CALL_PARSER, "sglang/other.py",
                           *(m.replace(".", "/") + ".py" for m in kit.EXECUTED_MODULES)]:
                zf.writestr(member, "app = None\n")
            zf.writestr(f"sglang-{version}.dist-info/METADATA", "Name: sglang\nRequires-Dist: torch==9.0.0\n")
        return wheel

    monkeypatch.setattr(sglang_wheel, "_download", fake_download)  # the download lives in the wheel module
    results = []
    threads = [threading.Thread(target=lambda: results.append(kit.source_dir("9.9.9"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = kit.cache_dir() / "9.9.9"
    assert calls == ["9.9.9"] and results == [out, out]
    assert (out / "COMPLETE").is_file() and (out / kit.IO_STRUCT).is_file()
    assert not (out / "sglang/other.py").exists()
    assert kit.requires_dist("9.9.9", "torch") == "9.0.0" and kit.requires_dist("9.9.9", "numpy") is None
    assert sorted(p.name for p in out.parent.iterdir()) == [".9.9.9.lock", "9.9.9"]


@pytest.mark.parametrize("version,gated", [("0.5.21", False), ("0.5.22", True), ("0.5.23", True)])
def test_generate_values_are_type_checked_where_the_release_has_its_contract_gate(version, gated):
    """0.5.22+ run /generate bodies through the generated schema decoder (api_contract.py) before
    the dataclass: a float max_new_tokens, a string temperature, a bool top_k are 400s there,
    though ``SamplingParams(**params)`` takes them. The kit runs that decoder from the wheel."""
    try:
        kit.source_dir(version)
    except kit.SGLangSourceError as exc:
        pytest.fail(str(exc), pytrace=False)
    assert (kit.generate_contract(version) is not None) is gated
    assert kit.check_request(version, "POST", "/generate", GENERATE) == []
    for bad in ({"max_new_tokens": 16.0}, {"temperature": "0.5"}, {"top_k": True}, {"stop_token_ids": [1.0]}):
        body = {**GENERATE, "sampling_params": {**GENERATE["sampling_params"], **bad}}
        problems = kit.check_request(version, "POST", "/generate", body)
        gate = [p for p in problems if "contract gate" in p]
        assert bool(gate) is gated, (bad, problems)
        if gated:
            assert "invalid type" in gate[0], gate
    assert kit.check_request(version, "POST", "/generate", {**GENERATE, "sampling_params": {"max_new_tokens": 16}}) == []
