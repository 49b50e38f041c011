"""The deployment's services for real, without containers: the rollout service, the sync agent
and the trainer started by their CLI commands with exactly the ``ASYNCRL_*`` environment that
compose.yaml gives their containers (resolved by ``docker compose config``) and the example
run config, against a real nats-server running ``docker/nats/nats.conf`` (accounts, users and
subject permissions) and a CPU engine with the API key the SGLang engines get.

What the test replaces, and only that (``REPLACED``): addresses and ports (everything binds
127.0.0.1 here instead of compose's service names), the run directories (one per service,
as the separate volumes), and the GPU-only settings (SGLang model, cuda, bf16) by their CPU
stand-ins; plus a small run size so a step and a weight sync happen in about a minute.

Then it checks what only a live system shows: both NATS users can do their work and nothing
more (anonymous clients, a trainer publishing trajectories and a rollout purging the stream
are refused), every metric the Grafana dashboard queries is exported by a service (scraped
here) or by a pinned third-party exporter, and the json_exporter module reads the sync
agent's real ``/status``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.jetstream import find_nats_server
from asyncrl.launch import ChildProcess, free_port, http_ok, port_open
from asyncrl.wire import NatsNames
from tests.deploy.conftest import REPO, container_environ
from tests.deploy.external_metrics import NATS_JSZ, sglang_series, varz_series
from tests.deploy.names import exported_series, json_exporter_series, metric_names
from tests.helpers.processes import start_engine
from tests.helpers.waiting import wait_for_sync

READY_S = 150.0  # torch + transformers imports of four processes on two busy cores
LOOP_S = 120.0  # first trainer step and first weight sync after readiness (~15 s here); within pytest-timeout
NOT_YET = (OSError, ValueError)  # a service still starting: refused connections, half-written files
RUN_TOML = REPO / "docker" / "config" / "run.toml"
SIZE = [  # a tiny run: a step needs one group of two short trajectories
    "model.max_model_len=512", "rollout.n=2", "rollout.response_length=64", "rollout.sampling.max_new_tokens=24",
    "rollout.multi_turn.max_assistant_turns=2", "rollout.multi_turn.max_user_turns=1", "rollout.test_freq=-1",
    "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=2",
    "async_training.trigger_parameter_sync_step=1",
]
CPU = ["model.path=builtin:tiny", "model.dtype=float32"]
REPLACED = {"run.dir", "nats.url", "engines.urls", "rollout.host", "rollout.port", "sync.host", "sync.port",
            "sync.rollout_url", "sync.url", "trainer.master_addr", "trainer.master_port", "trainer.weight_sync_port",
            "trainer.metrics_host", "trainer.metrics_port", "model.path", "model.dtype", "trainer.device",
            "trainer.mixed_precision"}


def _env(project: dict, service: str) -> dict[str, str]:
    """The service's environment, its /run/secrets paths pointing at the host's secret files."""
    return container_environ(project, service)


def _process_env(compose_env: dict[str, str]) -> dict[str, str]:
    """This machine's environment without config overrides, plus the container's variables."""
    base = {k: v for k, v in os.environ.items() if not (k.startswith("ASYNCRL_") and "__" in k)}
    return {**base, **compose_env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _value(text: str, name: str, **labels) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def _overrides_keys(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if "=" in a}


@pytest.fixture(scope="module")
def stack(one_box, compose_secrets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deploy-stack")
    nats_env, rollout_env = _env(one_box, "nats"), _env(one_box, "rollout")
    sync_env, trainer_env = _env(one_box, "sync-agent"), _env(one_box, "trainer")
    procs: dict[str, ChildProcess] = {}
    out: dict = {"tmp": tmp, "procs": procs, "secrets": compose_secrets, "env": {"nats": nats_env, "rollout": rollout_env, "sync": sync_env,
                                                      "trainer": trainer_env}}
    try:
        # NATS: docker/nats/nats.conf verbatim but for the store directory and the listeners.
        conf = (REPO / "docker" / "nats" / "nats.conf").read_text()
        assert conf.count("store_dir: /data") == 1
        conf_path = tmp / "nats.conf"
        conf_path.write_text(conf.replace("store_dir: /data", f"store_dir: {tmp / 'nats-data'}"))
        port, mport = free_port(), free_port()
        # through the service's own entry point, its passwords from the secret files
        server = Path(find_nats_server())
        entry = [*one_box["services"]["nats"]["entrypoint"]]
        assert entry == ["/bin/sh", "/etc/nats/entrypoint.sh"]
        nats_process_env = {**os.environ, **nats_env, "NATS_SECRETS_DIR": compose_secrets["dir"],
                            "PATH": f"{server.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        procs["nats"] = ChildProcess("nats", ["sh", str(REPO / "docker" / "nats" / "entrypoint.sh"), "-c", str(conf_path),
                                              "-a", "127.0.0.1", "-p", str(port), "-m", str(mport)], tmp / "nats.log",
                                     env=nats_process_env).start()
        procs["nats"].wait_ready(lambda: port_open("127.0.0.1", port), 20)
        out["nats_url"], out["nats_monitor"] = f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{mport}"

        engine = start_engine(tmp, api_key=Path(rollout_env["ASYNCRL_ENGINES__API_KEY_FILE"]).read_text())
        procs["engine"], out["engine_url"] = engine.proc, engine.url
        engine_url = engine.url
        urls = json.dumps([engine_url])
        rport, sport, tport = free_port(), free_port(), free_port()
        out["rollout_url"], out["sync_url"] = f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{sport}"
        out["trainer_metrics"] = f"http://127.0.0.1:{tport}/metrics"
        common = [*SIZE, *CPU, f"nats.url={out['nats_url']}", f"engines.urls={urls}"]
        args = {
            "rollout": ["rollout", str(RUN_TOML), *common, f"run.dir={tmp / 'rollout-volume' / 'run'}",
                        "rollout.host=127.0.0.1", f"rollout.port={rport}"],
            "sync": ["sync-agent", str(RUN_TOML), *common, f"run.dir={tmp / 'sync-volume' / 'run'}", "sync.host=127.0.0.1",
                     f"sync.port={sport}", f"sync.rollout_url={out['rollout_url']}"],
            "trainer": ["trainer", str(RUN_TOML), *common, f"run.dir={tmp / 'trainer-volume' / 'run'}",
                        "trainer.device=cpu", "trainer.mixed_precision=fp32", "trainer.master_addr=127.0.0.1",
                        f"trainer.master_port={free_port()}", f"trainer.weight_sync_port={free_port()}",
                        "trainer.metrics_host=127.0.0.1", f"trainer.metrics_port={tport}", f"sync.url={out['sync_url']}"],
        }
        out["args"] = args
        for name, env in (("rollout", rollout_env), ("sync", sync_env), ("trainer", trainer_env)):
            procs[name] = ChildProcess(name, [sys.executable, "-m", "launcher", *args[name]], tmp / f"{name}.log",
                                       env=_process_env(env)).start()
        wait_for_sync(lambda: http_ok(f"{out['rollout_url']}/health") and http_ok(f"{out['sync_url']}/health")
                      and http_ok(out["trainer_metrics"]), READY_S, "rollout, sync agent and trainer",
                      procs=procs.values(), retry_on=NOT_YET, interval_s=0.5)
        jsonl = tmp / "trainer-volume" / "run" / "metrics" / "trainer.jsonl"

        def looped():
            steps = [line for line in jsonl.read_text().splitlines() if line.strip()] if jsonl.is_file() else []
            synced = _value(_scrape(f"{out['sync_url']}/metrics"), "asyncrl_sync_syncs_total", state="succeeded")
            return len(steps) >= 1 and (synced or 0) >= 1

        wait_for_sync(looped, LOOP_S, "a trainer step and a succeeded weight sync", procs=procs.values(), retry_on=NOT_YET,
                      interval_s=0.5)
        out["nats_log_during_run"] = (tmp / "nats.log").read_text()
        out["pages"] = {
            "rollout": _scrape(f"{out['rollout_url']}/metrics"),
            "sync": _scrape(f"{out['sync_url']}/metrics"),
            "trainer": _scrape(out["trainer_metrics"]),
            "engine": _scrape(f"{engine_url}/metrics"),
        }
        token = Path(sync_env["ASYNCRL_SECURITY__STATUS_TOKEN_FILE"]).read_text()  # the json-exporter's read-only token
        req = urllib.request.Request(f"{out['sync_url']}/status", headers={"Authorization": f"Bearer {token}"})
        out["status"] = json.loads(urllib.request.urlopen(req, timeout=30).read())
        refused = urllib.request.Request(f"{out['sync_url']}/v1/syncs", data=b"{}", method="POST",
                                         headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(refused, timeout=30)
            out["status_token_post"] = 200
        except urllib.error.HTTPError as exc:
            out["status_token_post"] = exc.code
        out["varz"] = json.loads(_scrape(f"{out['nats_monitor']}/varz"))
        yield out
    finally:
        for name in ("trainer", "sync", "rollout", "engine", "nats"):
            if name in procs:
                procs[name].stop()


def test_services_take_the_compose_environment_as_is(stack):
    """Only addresses, run directories, CPU stand-ins and the run size were overridden."""
    for name, args in stack["args"].items():
        keys = _overrides_keys(args) - _overrides_keys(SIZE)
        assert keys <= REPLACED, f"{name}: overrides beyond addresses/CPU stand-ins: {sorted(keys - REPLACED)}"
    assert stack["env"]["rollout"]["ASYNCRL_NATS__USER"] == "rollout"
    assert stack["env"]["trainer"]["ASYNCRL_NATS__USER"] == "trainer"


def test_rollout_and_trainer_work_within_their_nats_permissions(stack):
    pages = stack["pages"]
    assert (_value(pages["rollout"], "asyncrl_rollout_published_total") or 0) >= 2
    assert (_value(pages["trainer"], "asyncrl_trainer_global_step") or 0) >= 1
    assert (_value(pages["sync"], "asyncrl_sync_weight_version") or 0) >= 1
    violations = [line for line in stack["nats_log_during_run"].splitlines() if "Violation" in line or "Authorization" in line]
    assert not violations, "NATS refused something the services needed:\n" + "\n".join(violations[:20])


async def _nats_attempt(url: str, user: str | None, password: str | None, action: str, run_id: str) -> tuple[bool, list[str]]:
    """Try ``action`` as ``user``; returns (succeeded, async errors the client received)."""
    import nats

    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    try:
        nc = await nats.connect(url, user=user, password=password, error_cb=on_error, allow_reconnect=False,
                                max_reconnect_attempts=0, connect_timeout=3)
    except Exception as exc:  # noqa: BLE001 - the refusal is what is tested
        return False, [*errors, repr(exc)]
    names = NatsNames(run_id)
    js = nc.jetstream()
    ok = True
    try:
        if action == "publish":
            await js.publish(names.trajectories, b"forged", headers={"Nats-Msg-Id": "forged-1"}, timeout=2)
        elif action == "purge":
            await js.purge_stream(names.stream)
        elif action == "consume":
            sub = await js.pull_subscribe_bind(durable=names.trainer_consumer, stream=names.stream)
            await sub.fetch(1, timeout=2)
        elif action == "stream_info":
            await js.stream_info(names.stream)
    except Exception as exc:  # noqa: BLE001
        ok = False
        errors.append(repr(exc))
    try:  # a round trip: the server answers in order, so every async error for the above has reached on_error
        await nc.flush(timeout=2)
    except Exception as exc:  # noqa: BLE001
        errors.append(repr(exc))
    await nc.close()
    return ok and not errors, errors


def test_nats_refuses_anonymous_clients_and_foreign_subjects(stack):
    url, secret = stack["nats_url"], stack["secrets"]
    run_id = tomllib.loads(RUN_TOML.read_text())["run"]["id"]
    ok, errors = asyncio.run(_nats_attempt(url, None, None, "stream_info", run_id))
    assert not ok and any("authorization" in e.lower() for e in errors), errors
    ok, errors = asyncio.run(_nats_attempt(url, "trainer", secret["nats_trainer_password"], "publish", run_id))
    assert not ok and any("permissions violation" in e.lower() for e in errors), errors
    ok, errors = asyncio.run(_nats_attempt(url, "rollout", secret["nats_rollout_password"], "purge", run_id))
    assert not ok and any("permissions violation" in e.lower() for e in errors), errors
    ok, errors = asyncio.run(_nats_attempt(url, "rollout", secret["nats_rollout_password"], "consume", run_id))
    assert not ok and any("permissions violation" in e.lower() for e in errors), errors
    ok, errors = asyncio.run(_nats_attempt(url, "rollout", secret["nats_trainer_password"], "stream_info", run_id))
    assert not ok and any("authorization" in e.lower() for e in errors), errors  # another user's password
    ok, errors = asyncio.run(_nats_attempt(url, "trainer", secret["nats_trainer_password"], "stream_info", run_id))
    assert ok, errors  # the same client can do what it is allowed to


def _dashboard_queries() -> list[str]:
    dash = json.loads((REPO / "docker" / "grafana" / "dashboards" / "asyncrl.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_only_exported_metrics(stack, deploy_tools):
    pages = stack["pages"]
    own = {name: exported_series(text) for name, text in pages.items() if name != "engine"}
    available = set().union(*own.values()) | sglang_series() | NATS_JSZ | varz_series(stack["varz"]) | json_exporter_series()
    queried: dict[str, set[str]] = {}
    for expr in _dashboard_queries():
        for name in metric_names(expr):
            queried.setdefault(name, set()).add(expr)
    missing = {n: sorted(e) for n, e in queried.items() if n not in available}
    assert not missing, f"the dashboard queries metrics no service exports: {json.dumps(missing, indent=1)}"
    # and it covers every service, not only the ones that happen to be up
    for source in ("rollout", "sync", "trainer"):
        assert queried.keys() & own[source], f"no panel shows the {source} metrics"
    assert any(n.startswith("sglang:") for n in queried) and any(n.startswith("jetstream_") for n in queried)
    # the CPU engine exports the SGLang load gauges under SGLang's names, so the panels work with it too
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs"} <= exported_series(pages["engine"])


def test_alert_rules_use_only_exported_metrics(stack, deploy_tools):
    pages = stack["pages"]
    available = set().union(*(exported_series(text) for name, text in pages.items() if name != "engine"))
    rules = yaml.safe_load((REPO / "docker" / "prometheus" / "alerts.yml").read_text())
    missing = {r["alert"]: sorted(metric_names(r["expr"]) - available) for g in rules["groups"] for r in g["rules"]}
    assert not any(missing.values()), f"alert rules on metrics no service exports: {missing}"


def _jsonpath(doc, path: str):
    """The subset of Kubernetes JSONPath the json_exporter config uses: {.a}, {.a[*]}, {@}."""
    inner = path.strip()[1:-1].strip()
    if inner == "@":
        return [doc]
    m = re.fullmatch(r"\.(\w+)(\[\*\])?", inner)
    assert m, f"unsupported JSONPath {path!r} (extend this check with the config)"
    value = doc.get(m.group(1)) if isinstance(doc, dict) else None
    return value if m.group(2) else value


def test_json_exporter_reads_the_real_sync_agent_status(stack):
    cfg = yaml.safe_load((REPO / "docker" / "json-exporter" / "config.yml").read_text())
    status = stack["status"]
    (module,) = cfg["modules"].values()
    assert module["http_client_config"]["authorization"]["credentials_file"] == "/run/secrets/status_token"
    assert stack["status_token_post"] == 403, "the status token must not start a sync (issue 30)"
    for m in module["metrics"]:
        objects = _jsonpath(status, m["path"])
        assert isinstance(objects, list) and objects, f"{m['name']}: {m['path']} selects nothing in {status}"
        for obj in objects:
            for key, path in {**m.get("labels", {}), **m.get("values", {})}.items():
                assert _jsonpath(obj, path) is not None, f"{m['name']}: {key} = {path} is missing in {obj}"
    engine = status["engines"][0]
    assert engine["url"] == stack["engine_url"] and engine["alive"] is True and engine["version"] >= 1
