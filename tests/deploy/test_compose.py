"""compose.yaml and compose.cluster.yaml as Docker Compose v2 resolves them (``config``): valid,
secrets required, roles per node, ports, healthchecks, commands that exist in the CLI, and
``ASYNCRL_*`` variables that are real config fields accepted by the config loader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from asyncrl.config import ConfigError, load_config
from asyncrl.config.run_config import RunConfig
from launcher.cli import COMMANDS
from tests.deploy.conftest import (
    ALL_PROFILES,
    CLUSTER_ADDRS,
    REPO,
    ROLE_SECRETS,
    SECRET_NAMES,
    SECRETS_MOUNT,
    container_environ,
    make_secrets,
    parse_env_text,
)

RUN_TOML = REPO / "docker" / "config" / "run.toml"
ROLES = {
    "control": {"nats", "rollout", "sync-agent", "gateway", "python-sandbox"},
    "engine": {"sglang"},
    "trainer": {"trainer"},
    "monitoring": {"prometheus", "grafana", "nats-exporter", "json-exporter"},
    # without GPUs (./dev test-cluster runs them on three nodes)
    "cpu-engine": {"engine-cpu", "model-init"},
    "cpu-trainer": {"trainer-cpu", "model-init"},
}
ASYNCRL_SERVICES = {"rollout": "rollout", "sync-agent": "sync-agent", "trainer": "trainer"}


def test_one_box_project_is_valid_and_runs_every_role(one_box):
    assert one_box["name"] == "asyncrl"
    assert set(one_box["services"]) == set().union(*(ROLES[r] for r in ALL_PROFILES.split(",")))


SECRET_WORDS = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|API_KEY|PRIVATE", re.I)


def test_no_secret_in_the_env_files_and_compose_refuses_without_secrets_dir(compose, tmp_path):
    """Issue 30 item 8: secrets are files (Docker secrets), never variables of .env: the example
    files name none, and compose refuses to start until SECRETS_DIR is set."""
    from tests.deploy.conftest import Compose

    for name in (".env.example", ".env.cpu.example"):
        example = parse_env_text((REPO / name).read_text())
        assert not [k for k in example if SECRET_WORDS.search(k) and k != "SECRETS_DIR"], f"{name} holds secrets: {sorted(example)}"
        assert example["SECRETS_DIR"] == "./secrets", name
    text = "\n".join(line for line in (REPO / ".env.example").read_text().splitlines() if not line.startswith("SECRETS_DIR="))
    path = tmp_path / ".env"
    path.write_text(text + "\n")
    proc = Compose(compose.binary, path).run("config", "--quiet")
    assert proc.returncode != 0 and "SECRETS_DIR" in proc.stderr and "make-secrets.sh" in proc.stderr, proc.stderr


def test_every_secret_is_a_file_of_the_secrets_dir_read_through_a_file_variable(one_box, compose_secrets):
    """Each secret of compose.yaml is ``$SECRETS_DIR/<name>`` (what make-secrets.sh writes); a
    service gets it mounted at /run/secrets/<name> and reads it through a ``*_FILE`` variable; no
    service's configuration (``docker inspect``) holds a secret's value or a secret variable."""
    declared = one_box["secrets"]
    assert set(declared) == set(SECRET_NAMES)
    assert all(declared[name]["file"] == f"{compose_secrets['dir']}/{name}" for name in SECRET_NAMES), declared
    script = (REPO / "docker" / "make-secrets.sh").read_text()
    assert tuple(re.search(r"NAMES=\(([^)]*)\)", script).group(1).split()) == SECRET_NAMES
    values = {v for k, v in compose_secrets.items() if k != "dir"}
    used = set()
    for name, svc in one_box["services"].items():
        env = {k: "" if v is None else str(v) for k, v in (svc.get("environment") or {}).items()}
        for key, value in env.items():
            assert value not in values, f"{name}: {key} holds a secret's value"
            if SECRET_WORDS.search(key):
                assert key.endswith("_FILE") and value.startswith(SECRETS_MOUNT), f"{name}: {key}={value} is not a secret file"
        for ref in svc.get("secrets", []):
            used.add(ref["source"])
        assert set(container_environ(one_box, name)) == set(env)  # every /run/secrets path is mounted
    assert used == set(SECRET_NAMES), f"declared but unused: {set(SECRET_NAMES) - used}"
    # the sync agent's read-only token is the exporter's; the sync token is not
    assert [r["source"] for r in one_box["services"]["json-exporter"]["secrets"]] == ["status_token"]


ASYNCRL_IMAGES = ("asyncrl/service", "asyncrl/trainer")


def test_asyncrl_services_run_with_a_read_only_root(one_box, cpu_box):
    """Issue 30 item 8: every service of asyncrl's images has a read-only root and a size-capped
    /tmp; state goes to volumes. Run for real under Docker by tests/deploy/test_compose_run.py."""
    checked = set()
    for project in (one_box, cpu_box):
        for name, svc in project["services"].items():
            if not svc["image"].startswith(ASYNCRL_IMAGES) or name == "network-check":
                continue
            assert svc.get("read_only") is True, f"{name}: writable root"
            assert any(t.startswith("/tmp:size=") for t in svc.get("tmpfs", [])), f"{name}: no size-capped /tmp"
            checked.add(name)
    assert checked == {"rollout", "sync-agent", "python-sandbox", "trainer", "model-init", "engine-cpu", "trainer-cpu"}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_each_role_mounts_exactly_the_secrets_the_docs_tell_its_nodes_to_hold(compose, role):
    project = compose.config(files=("compose.yaml", "compose.cluster.yaml"), profiles=role, env=CLUSTER_ADDRS)
    used = {s["source"] for svc in project["services"].values() for s in svc.get("secrets", [])}
    assert used == ROLE_SECRETS[role]
    table = (REPO / "docs" / "deployment.md").read_text()
    rows = re.findall(rf"^\s*\| `{re.escape(role)}` \| ((?:`[a-z_]+`(?:, )?)+) \|$", table, re.M)  # the secrets table
    assert len(rows) == 1 and set(re.findall(r"`([a-z_]+)`", rows[0])) == ROLE_SECRETS[role], rows


@pytest.mark.parametrize("role", sorted(ROLES))
def test_cluster_node_roles(compose, role):
    project = compose.config(files=("compose.yaml", "compose.cluster.yaml"), profiles=role, env=CLUSTER_ADDRS)
    assert set(project["services"]) == ROLES[role] | {"network-check"}  # every node checks its addresses first
    svc = project["services"]
    for name in ROLES[role] & CHECKED_FIRST:
        assert svc[name]["depends_on"]["network-check"]["condition"] == "service_completed_successfully", name
    if role == "engine":
        assert svc["sglang"]["network_mode"] == "host"
        assert svc["sglang"]["environment"]["ENGINE_HOST"] == CLUSTER_ADDRS["NODE_ADDR"]
        assert svc["sglang"]["environment"]["ENGINE_PORT_PER_SLOT"] == "1"
    if role == "trainer":
        env = svc["trainer"]["environment"]
        assert svc["trainer"]["network_mode"] == "host" and set(svc["trainer"]["depends_on"]) == {"network-check"}
        assert env["ASYNCRL_TRAINER__MASTER_ADDR"] == CLUSTER_ADDRS["MASTER_ADDR"]
        assert env["ASYNCRL_NATS__URL"] == f"nats://{CLUSTER_ADDRS['CONTROL_ADDR']}:4222"
        assert env["ASYNCRL_SYNC__URL"] == f"http://{CLUSTER_ADDRS['CONTROL_ADDR']}:8100"
    if role == "cpu-engine":
        engine = svc["engine-cpu"]
        assert engine["network_mode"] == "host" and not engine.get("expose")
        assert engine["depends_on"]["network-check"]["condition"] == "service_completed_successfully"
        flags = engine["command"]
        assert flags[flags.index("--host") + 1] == CLUSTER_ADDRS["NODE_ADDR"] and "--port-slots" in flags
        slots = flags[flags.index("--slot-dir") + 1]  # the replicas' locks in a volume of the node (issue 67 L6)
        assert any(v["target"] == slots and v["type"] == "volume" for v in engine["volumes"]), engine["volumes"]
        assert "/tmp/asyncrl-engine-addr" in flags and "asyncrl-engine-addr" in " ".join(engine["healthcheck"]["test"])
    if role == "cpu-trainer":
        trainer = svc["trainer-cpu"]
        env = trainer["environment"]
        assert trainer["network_mode"] == "host" and not trainer.get("networks")
        assert set(trainer["depends_on"]) == {"network-check", "model-init"}
        assert env["ASYNCRL_TRAINER__MASTER_ADDR"] == CLUSTER_ADDRS["MASTER_ADDR"]
        assert env["ASYNCRL_TRAINER__METRICS_HOST"] == CLUSTER_ADDRS["NODE_ADDR"]
        assert env["ASYNCRL_NATS__URL"] == f"nats://{CLUSTER_ADDRS['CONTROL_ADDR']}:4222"
        assert env["ASYNCRL_SYNC__URL"] == f"http://{CLUSTER_ADDRS['CONTROL_ADDR']}:8100"
    if role == "control":
        for name, port in (("nats", 4222), ("sync-agent", 8100)):
            (p,) = svc[name]["ports"]
            assert (p["host_ip"], int(p["published"]), p["target"]) == (CLUSTER_ADDRS["CONTROL_ADDR"], port, port)
    if role == "monitoring":
        assert svc["prometheus"]["extra_hosts"] == [f"trainer={CLUSTER_ADDRS['MASTER_ADDR']}"]


CHECKED_FIRST = {"nats", "rollout", "sync-agent", "gateway", "python-sandbox", "sglang", "trainer"}
"""The cluster's services that open ports to other nodes or reach them: each waits for network-check."""


def test_the_cluster_refuses_public_addresses_before_anything_starts(compose):
    """Issue 30 item 8: a one-shot ``python -m asyncrl.netcheck`` with the three addresses the
    cluster file publishes or host-networks, no capability, no port, a read-only root; every
    service that reaches another node waits for it to succeed (tests/foundation/test_netcheck.py
    checks the command itself)."""
    project = compose.config(files=("compose.yaml", "compose.cluster.yaml"), profiles=ALL_PROFILES, env=CLUSTER_ADDRS)
    check = project["services"]["network-check"]
    assert check["entrypoint"] == ["python", "-m", "asyncrl.netcheck", "--this-node=NODE_ADDR"]
    assert check["command"] == [f"{k}={CLUSTER_ADDRS[k]}" for k in ("NODE_ADDR", "CONTROL_ADDR", "MASTER_ADDR")]
    assert check["cap_drop"] == ["ALL"] and check["read_only"] is True and not check.get("ports")
    assert check["restart"] == "no" and not check.get("profiles")
    waiting = {name for name, s in project["services"].items() if "network-check" in (s.get("depends_on") or {})}
    assert CHECKED_FIRST <= waiting
    ports = [(name, p) for name, s in project["services"].items() for p in s.get("ports", [])]
    published = {name: p.get("host_ip") for name, p in ports if name not in ("gateway", "grafana")}
    assert published == {"nats": CLUSTER_ADDRS["CONTROL_ADDR"], "sync-agent": CLUSTER_ADDRS["CONTROL_ADDR"]}, ports


def test_multi_node_trainer_world_from_env(compose):
    env = {**CLUSTER_ADDRS, "NNODES": "3", "NODE_RANK": "2", "MASTER_PORT": "29511", "TRAINER_NPROC": "8"}
    project = compose.config(files=("compose.yaml", "compose.cluster.yaml"), profiles="trainer", env=env)
    cfg = load_config(RUN_TOML, environ=container_environ(project, "trainer"))
    t = cfg.trainer
    assert (t.nnodes, t.node_rank, t.nproc_per_node, t.master_addr, t.master_port) == (3, 2, 8, CLUSTER_ADDRS["MASTER_ADDR"], 29511)
    from trainer_daemon.launch import torchrun_argv

    argv = torchrun_argv(cfg.trainer, [str(RUN_TOML)])
    joined = " ".join(argv)
    assert "--nnodes 3 --nproc-per-node 8 --node-rank 2" in joined and f"--master-addr {CLUSTER_ADDRS['MASTER_ADDR']} --master-port 29511" in joined


def test_only_the_openai_port_is_published(one_box):
    published = {name: s.get("ports", []) for name, s in one_box["services"].items() if s.get("ports")}
    assert set(published) == {"gateway", "grafana"}, published
    (gw,) = published["gateway"]
    assert (int(gw["published"]), gw["target"]) == (8000, 8080)
    (gf,) = published["grafana"]
    assert gf["host_ip"] == "127.0.0.1", "Grafana is published on loopback only"
    for name, s in one_box["services"].items():
        allowed = ("none",) if name == "python-sandbox" else (None, "bridge")
        assert s.get("network_mode") in allowed, f"{name} uses {s.get('network_mode')} on one box"


def test_the_python_tool_runs_in_a_sandbox_container_with_no_way_out(one_box):
    """Issue 30 item 2: the rollout service (uid 10001, no capabilities) cannot isolate model
    code, so its programs run in python-sandbox: no network, no secrets, read-only root,
    limits, only the capabilities per-run uids need; reached on a socket volume only the
    rollout mounts."""
    s = one_box["services"]
    box = s["python-sandbox"]
    assert box["network_mode"] == "none" and box["read_only"] is True and box["user"] == "0:0"
    assert box["cap_drop"] == ["ALL"] and set(box["cap_add"]) == {"SETUID", "SETGID", "CHOWN", "KILL", "DAC_OVERRIDE", "FOWNER"}
    assert "no-new-privileges:true" in box["security_opt"]
    assert box["pids_limit"] > 0 and int(box["mem_limit"]) > 0 and float(box["cpus"]) > 0
    assert any(t.startswith("/tmp:size=") for t in box["tmpfs"])
    assert not box.get("environment"), "nothing secret (nothing at all) in the sandbox's environment"
    assert box["command"][:1] == ["python-sandbox"] and box["command"][box["command"].index("--owner") + 1] == "10001"
    sockets = {name for name, svc in s.items() for v in svc.get("volumes", []) if v.get("source") == "sandbox-socket"}
    assert sockets == {"python-sandbox", "rollout"}
    socket_path = box["command"][box["command"].index("--socket") + 1]
    assert s["rollout"]["environment"]["ASYNCRL_ROLLOUT__PYTHON_SANDBOX_URL"] == f"unix://{socket_path}"


# Pulled images whose digest could not be read where this is built (no container registry is
# reachable; no public source gives these tags' digests): pinned by tag until an operator runs
# `docker buildx imagetools inspect` on them (docs/security.md, point 8). Nothing else may be.
UNPINNED = {"lmsysorg/sglang", "natsio/prometheus-nats-exporter"}
PINNED_REF = re.compile(r"^(?P<repo>[a-z0-9./_-]+):(?P<tag>[\w][\w.-]*)(?P<digest>@sha256:[0-9a-f]{64})?$")
BUILT_HERE = ("asyncrl/service", "asyncrl/trainer")  # built by `docker compose build`, never pulled


def _check_pinned(where: str, ref: str) -> None:
    m = PINNED_REF.match(ref)
    assert m and m["tag"] != "latest", f"{where}: image {ref!r} is not pinned to a tag"
    if m["repo"] not in UNPINNED and not m["repo"].startswith(BUILT_HERE):
        assert m["digest"], f"{where}: image {ref!r} is pulled by tag only: pin its digest (tag@sha256:...)"


def test_every_service_has_a_healthcheck_restart_policy_and_pinned_image(one_box):
    """Issue 30 item 7: every image compose or a Dockerfile pulls is pinned by digest (a re-pushed
    tag cannot change what runs), but for the two named in UNPINNED."""
    for name, s in one_box["services"].items():
        hc = s.get("healthcheck") or {}
        assert hc.get("test") and not hc.get("disable"), f"{name} has no healthcheck"
        assert s.get("restart") in ("unless-stopped", "on-failure", "always"), f"{name}: restart {s.get('restart')}"
        _check_pinned(name, s["image"])
        for arg, ref in (s.get("build") or {}).get("args", {}).items():
            _check_pinned(f"{name}: build arg {arg}", ref)
    defaults = 0
    for dockerfile in sorted((REPO / "docker").rglob("*.Dockerfile")):
        for arg, ref in re.findall(r"^ARG (\w*IMAGE)=(\S+)$", dockerfile.read_text(), re.M):
            _check_pinned(f"{dockerfile.name}: ARG {arg}", ref)
            defaults += 1
    assert defaults >= 5
    with pytest.raises(AssertionError, match="pulled by tag only"):
        _check_pinned("a check that can fail", "nats:2.12.1-alpine")


def test_volumes_keep_state(one_box):
    s = one_box["services"]
    mounts = {name: {v["target"]: v for v in svc.get("volumes", [])} for name, svc in s.items()}
    assert mounts["nats"]["/data"]["type"] == "volume"
    assert mounts["rollout"]["/var/lib/asyncrl"]["type"] == "volume"  # the run dir with the outbox
    assert mounts["sync-agent"]["/var/lib/asyncrl"]["type"] == "volume"
    assert mounts["trainer"]["/var/lib/asyncrl"]["type"] == "volume"
    for name in ASYNCRL_SERVICES:
        run_cfg = mounts[name]["/etc/asyncrl/run.toml"]
        assert run_cfg["read_only"] and run_cfg["source"] == str(RUN_TOML)
        assert s[name]["environment"]["ASYNCRL_RUN__DIR"].startswith("/var/lib/asyncrl/")


def _entrypoint(dockerfile: str) -> list[str]:
    text = (REPO / "docker" / dockerfile).read_text()
    return yaml.safe_load(re.findall(r"^ENTRYPOINT (.+)$", text, re.M)[-1])


def test_commands_exist_in_the_cli(one_box, capsys):
    from launcher.cli import main

    s = one_box["services"]
    assert _entrypoint("service.Dockerfile") == ["asyncrl"]
    assert _entrypoint("trainer.Dockerfile") == ["asyncrl", "trainer"]
    for name in ("rollout", "sync-agent"):
        cmd = s[name]["command"]
        assert cmd[0] in COMMANDS, f"{name}: asyncrl {cmd[0]} is not a command"
        assert cmd[1] == "/etc/asyncrl/run.toml"
        with pytest.raises(SystemExit) as exc:
            main([cmd[0], "--help"])
        assert exc.value.code == 0
    assert "trainer" in COMMANDS and s["trainer"]["command"] == ["/etc/asyncrl/run.toml"]
    assert main(["trainer", "--help"]) == 0
    assert s["python-sandbox"]["command"][0] == "python-sandbox" and "python-sandbox" in COMMANDS
    with pytest.raises(SystemExit) as exc:
        main(["python-sandbox", "--help"])
    assert exc.value.code == 0
    capsys.readouterr()


def _field_exists(dotted: str) -> bool:
    model = RunConfig
    for part in dotted.split("."):
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return False
        ann = fields[part].annotation
        model = ann if isinstance(ann, type) else None
    return True


def test_every_asyncrl_variable_is_a_config_field(one_box, compose):
    cluster = compose.config(files=("compose.yaml", "compose.cluster.yaml"), profiles=ALL_PROFILES, env=CLUSTER_ADDRS)
    example = parse_env_text((REPO / ".env.example").read_text())
    sources = {f"{kind}:{name}": s.get("environment", {}) for kind, project in (("one-box", one_box), ("cluster", cluster))
               for name, s in project["services"].items()}
    sources[".env.example"] = example
    checked = 0
    for where, env in sources.items():
        for key in env:
            if not key.startswith("ASYNCRL_"):
                continue
            assert "__" in key, f"{where}: {key} is not a config override (ASYNCRL_SECTION__KEY)"
            dotted = ".".join(p.lower() for p in key[len("ASYNCRL_"):].split("__")).removesuffix("_file")
            assert _field_exists(dotted), f"{where}: {key} → {dotted} is not a RunConfig field"
            checked += 1
    assert checked > 40


@pytest.mark.parametrize("service", sorted(ASYNCRL_SERVICES))
def test_service_environment_loads_with_the_example_run_config(one_box, service):
    env = container_environ(one_box, service)  # the secrets read from their files, as in the container
    try:
        cfg = load_config(RUN_TOML, environ=env)
    except ConfigError as exc:
        pytest.fail(f"{service}: the container's config is invalid:\n{exc}")
    assert cfg.engines.backend == "sglang" and cfg.engines.urls == ["http://asyncrl-sglang-1:30000"]
    if service == "rollout":
        assert (cfg.rollout.host, cfg.rollout.port, cfg.nats.user) == ("0.0.0.0", 8000, "rollout")
        assert cfg.security.admin_token and cfg.security.api_token and cfg.security.nats_password
        assert cfg.security.admin_token.get_secret_value() != cfg.security.api_token.get_secret_value()
    if service == "sync-agent":
        assert (cfg.sync.host, cfg.sync.port, cfg.sync.rollout_url) == ("0.0.0.0", 8100, "http://rollout:8000")
        assert cfg.security.sync_token and cfg.security.admin_token
    if service == "trainer":
        t = cfg.trainer
        assert (t.device, t.mixed_precision, t.metrics_host, t.metrics_port) == ("cuda", "bf16", "0.0.0.0", 9400)
        assert (cfg.nats.user, cfg.sync.url, t.master_addr) == ("trainer", "http://sync-agent:8100", "trainer")
        assert t.weight_sync_port == 29600 and t.master_port == 29500


def _scrape_targets() -> dict[str, list[str]]:
    prom = yaml.safe_load((REPO / "docker" / "prometheus" / "prometheus.yml").read_text())
    out = {}
    for job in prom["scrape_configs"]:
        targets = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        targets += [f"{n}:{d['port']}" for d in job.get("dns_sd_configs", []) for n in d["names"]]
        out[job["job_name"]] = targets
    return out


def test_prometheus_scrapes_every_service_on_its_metrics_port(one_box):
    s = one_box["services"]
    targets = _scrape_targets()
    cfg = {name: load_config(RUN_TOML, environ=container_environ(one_box, name)) for name in ASYNCRL_SERVICES}
    exporter_port = re.search(r"-port=(\d+)", " ".join(s["nats-exporter"]["command"])).group(1)
    expected = {
        "rollout": f"rollout:{cfg['rollout'].rollout.port}",
        "sync-agent": f"sync-agent:{cfg['sync-agent'].sync.port}",
        "trainer": f"trainer:{cfg['trainer'].trainer.metrics_port}",
        "engines": f"sglang:{s['sglang']['environment']['ENGINE_PORT']}",
        "nats": f"nats-exporter:{exporter_port}",
    }
    for job, target in expected.items():
        assert target in targets[job], f"job {job} scrapes {targets[job]}, the service serves {target}"
        host, port = target.split(":")
        assert port in [str(p) for p in s[host]["expose"]], f"{host} does not expose {port}"
    probe = next(j for j in yaml.safe_load((REPO / "docker" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
                 if j["job_name"] == "engine-versions")
    assert targets["engine-versions"] == [f"http://sync-agent:{cfg['sync-agent'].sync.port}/status"]
    assert probe["relabel_configs"][-1]["replacement"] == "json-exporter:7979" and "7979" in s["json-exporter"]["expose"]
    assert probe["params"]["module"] == list(yaml.safe_load((REPO / "docker" / "json-exporter" / "config.yml").read_text())["modules"])
    assert s["json-exporter"]["secrets"][0]["source"] == "status_token"  # read-only: never the sync token
    # every service that serves metrics is scraped
    scraped_hosts = {t.split(":")[0] for ts in targets.values() for t in ts}
    assert {"rollout", "sync-agent", "trainer", "sglang", "nats-exporter"} <= scraped_hosts


def test_grafana_datasource_points_at_prometheus(one_box):
    ds = yaml.safe_load((REPO / "docker" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["url"] == "http://prometheus:9090" and "9090" in one_box["services"]["prometheus"]["expose"]
    provider = yaml.safe_load((REPO / "docker" / "grafana" / "provisioning" / "dashboards" / "asyncrl.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    mounts = {v["target"]: v["source"] for v in one_box["services"]["grafana"]["volumes"]}
    assert mounts[path] == str(REPO / "docker" / "grafana" / "dashboards")


def test_engines_get_the_flags_the_system_needs(one_box, tmp_path):
    """engine.sh (the sglang entry point) with the service's environment, in dry-run mode."""
    import subprocess

    s = one_box["services"]["sglang"]
    assert s["entrypoint"] == ["/bin/bash", "/opt/asyncrl/engine.sh"]
    env = container_environ(one_box, "sglang")  # ENGINE_API_KEY_FILE: the host's secret file
    env.update(PATH="/usr/bin:/bin", ENGINE_DRY_RUN="1", ENGINE_SLOT_DIR=str(tmp_path / "slots"),
               ENGINE_ADDR_FILE=str(tmp_path / "addr"), TMPDIR=str(tmp_path))  # its secrets dir: in the test's tmp
    # asyncrl's SGLang hook where compose mounts it (issue 66 N7): the bind's source in this checkout
    hook = next(v for v in s["volumes"] if v.get("target") == "/opt/asyncrl/sglang_hooks")
    env["ENGINE_HOOK_DIR"] = str((REPO / hook["source"]).resolve())
    assert (Path(env["ENGINE_HOOK_DIR"]) / "sitecustomize.py").is_file() and hook["read_only"]
    out = subprocess.run(["bash", str(REPO / "docker" / "sglang" / "engine.sh")], env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "(weight-group timeout: 360 s" in out.stderr and env["ENGINE_WEIGHT_GROUP_TIMEOUT_S"] == "360"
    argv = out.stdout.split("\n")
    flags = dict(zip(argv, argv[1:], strict=False))
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert "--enable-metrics" in argv
    assert flags["--tool-call-parser"] == "qwen" and "--api-key" not in argv
    secrets = Path(flags["--config"])  # the key in a file only the server's user reads (issue 30, item 8)
    key = Path(env["ENGINE_API_KEY_FILE"]).read_text()
    assert yaml.safe_load(secrets.read_text()) == {"api-key": key}
    assert secrets.stat().st_mode & 0o077 == 0 and secrets.parent.stat().st_mode & 0o077 == 0
    assert flags["--tp-size"] == "1" and "--tp" not in argv  # the flag sglang has (--tp is not one)
    assert (flags["--host"], flags["--port"]) == ("0.0.0.0", "30000")
    assert flags["--model-path"] == one_box["services"]["rollout"]["environment"]["ASYNCRL_MODEL__PATH"]
    rollout_key = Path(container_environ(one_box, "rollout")["ASYNCRL_ENGINES__API_KEY_FILE"]).read_text()
    assert rollout_key == key and key not in out.stdout + out.stderr


# -- the CPU profile (.env.cpu.example; run for real by tests/deploy/test_compose_run.py) ------
CPU_STANDINS = {"model-init", "engine-cpu", "trainer-cpu"}


@pytest.fixture(scope="module")
def cpu_box(deploy_tools, tmp_path_factory) -> dict:
    from tests.deploy.conftest import Compose

    secrets_dir = tmp_path_factory.mktemp("cpu-secrets") / "secrets"
    make_secrets(secrets_dir)
    env = parse_env_text((REPO / ".env.cpu.example").read_text()) | {"SECRETS_DIR": str(secrets_dir)}
    path = tmp_path_factory.mktemp("cpu-env") / ".env"
    path.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return Compose(deploy_tools.compose, path).config(profiles=None)


def test_cpu_profile_is_the_deployment_with_cpu_stand_ins(one_box, cpu_box):
    s = cpu_box["services"]
    gpu_only = {"sglang", "trainer"}
    assert set(s) == (set(one_box["services"]) - gpu_only) | CPU_STANDINS
    for name in set(s) - CPU_STANDINS:  # the same services as on GPUs, only the engines' backend differs
        mine, theirs = s[name], one_box["services"][name]
        assert mine["image"] == theirs["image"] and mine.get("command") == theirs.get("command"), name
        diff = {k for k in set(mine.get("environment", {})) | set(theirs.get("environment", {}))
                if mine.get("environment", {}).get(k) != theirs.get("environment", {}).get(k)}
        assert diff <= {"ASYNCRL_ENGINES__BACKEND", "ASYNCRL_ENGINES__URLS", "ASYNCRL_MODEL__PATH",
                        "ASYNCRL_API__PUBLIC_URL"}, (name, diff)
        assert mine.get("secrets") == theirs.get("secrets"), name
    assert s["rollout"]["environment"]["ASYNCRL_ENGINES__BACKEND"] == "local"
    trainer, gpu_trainer = s["trainer-cpu"], one_box["services"]["trainer"]
    assert trainer["image"] == s["rollout"]["image"] and trainer["command"] == ["trainer", "/etc/asyncrl/run.toml"]
    assert trainer["environment"]["ASYNCRL_TRAINER__DEVICE"] == "cpu"
    assert set(gpu_trainer["environment"]) - set(trainer["environment"]) == {"CUDA_VISIBLE_DEVICES"}
    assert "trainer" in trainer["networks"]["default"]["aliases"]  # MASTER_ADDR and Prometheus' target
    assert trainer["restart"] == "on-failure" and trainer["init"] is True
    engine = s["engine-cpu"]
    assert engine["command"][:3] == ["engine", "--model", s["rollout"]["environment"]["ASYNCRL_MODEL__PATH"]]
    assert engine["environment"]["LOCAL_ENGINE_API_KEY_FILE"] == s["rollout"]["environment"]["ASYNCRL_ENGINES__API_KEY_FILE"]
    assert [r["source"] for r in engine["secrets"]] == ["engine_api_key"]
    assert set(trainer["environment"]) - {"ASYNCRL_TRAINER__CHECKPOINT__SAVE_FREQ"} <= set(gpu_trainer["environment"])
    assert trainer["secrets"] == gpu_trainer["secrets"]
    urls = yaml.safe_load(s["rollout"]["environment"]["ASYNCRL_ENGINES__URLS"])
    assert urls == [f"http://asyncrl-engine-cpu-{i}:30000" for i in range(1, int(engine["deploy"]["replicas"]) + 1)]
    init = s["model-init"]
    assert init["entrypoint"][-1] == "--export" and init["command"] == [s["rollout"]["environment"]["ASYNCRL_MODEL__PATH"]]
    for name in ("rollout", "engine-cpu", "trainer-cpu"):
        assert s[name]["depends_on"]["model-init"]["condition"] == "service_completed_successfully", name
    load_config(str(REPO / "launcher" / "up" / "demo.toml"), environ=container_environ(cpu_box, "trainer-cpu"))


def test_prometheus_finds_the_cpu_engines():
    prom = yaml.safe_load((REPO / "docker" / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "engines"]
    assert "engine-cpu" in job["dns_sd_configs"][0]["names"]


def test_nats_and_the_engines_run_without_capabilities_or_the_hosts_ipc(one_box):
    """Issue 30 item 8: nats (run under Docker by ./dev test-deploy) and sglang (GPU only: not run
    here) drop every capability and cannot gain privileges; nats' root is read-only (it writes
    its store on its volume only); sglang gets sized shared memory instead of ``ipc: host``."""
    s = one_box["services"]
    for name in ("nats", "sglang"):
        svc = s[name]
        assert svc["cap_drop"] == ["ALL"] and "no-new-privileges:true" in svc["security_opt"], name
        assert svc.get("ipc") is None, f"{name} shares the host's IPC namespace"
    assert s["nats"]["read_only"] is True
    assert s["sglang"]["shm_size"]


ADDED_BACK = {
    "model-init": {"DAC_OVERRIDE"},
    # per-run uids: the sandbox creates, owns and kills them (docs/security.md, the sandbox)
    "python-sandbox": {"CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID"},
}


def test_every_service_drops_every_capability_and_none_shares_the_hosts_ipc(compose, one_box):
    """Issue 48 item 12: trainer, gateway, grafana and model-init kept their capabilities and the
    cluster's trainer shared the host's IPC namespace. Now every service of both files drops
    them all (model-init adds back DAC_OVERRIDE alone, to write a MODELS_DIR another user owns)."""
    cluster = compose.config(files=("compose.yaml", "compose.cluster.yaml"), profiles=ALL_PROFILES, env=CLUSTER_ADDRS)
    for where, project in (("one box", one_box), ("cluster", cluster)):
        for name, svc in project["services"].items():
            assert svc.get("cap_drop") == ["ALL"], f"{where}: {name} keeps capabilities"
            assert set(svc.get("cap_add") or []) <= ADDED_BACK.get(name, set()), (where, name)
            assert svc.get("ipc") is None, f"{where}: {name} shares the host's IPC namespace"
    assert cluster["services"]["trainer"]["shm_size"]


def test_the_engine_image_is_a_checked_release_on_which_every_pause_policy_is_exact():
    """compose and the trainer image pin one SGLang release; the contract kit checks the
    product's requests against it (``tests.contract.sglang_source.PINNED``), and on it every
    documented pause policy is exact (docs/deployment.md, "SGLang versions"): weight-version spans
    for retract and in_place (0.5.19+), a paused engine's flush that ignores its retracted queue
    (0.5.21+: before, the retracted requests re-prefill over prompt KV of the old weights)."""
    from local_engine.compat import SglangCompat
    from tests.contract.sglang_source import PINNED

    tags = set(re.findall(r"lmsysorg/sglang:v([0-9.]+)", (REPO / "compose.yaml").read_text()))
    tags |= set(re.findall(r"lmsysorg/sglang:v([0-9.]+)", (REPO / "docker" / "trainer.Dockerfile").read_text()))
    assert len(tags) == 1, tags
    [version] = tags
    compat = SglangCompat.of(version)
    assert version in PINNED and compat.weight_version_spans and compat.flush_ignores_queue_when_paused, version
