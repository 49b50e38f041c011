"""The Dockerfiles (hadolint, plus the rules that matter here checked directly), the build
context (.dockerignore), the SGLang entry point script and the gateway's routing."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.deploy.conftest import REPO
from tests.helpers.waiting import wait_for_sync

PROJECT_DOCKERFILES = ["service.Dockerfile", "trainer.Dockerfile"]  # built from the repository root
# stand-ins for third-party images where no registry is reachable (context: docker/local-images)
LOCAL_DOCKERFILES = ["local-images/nats.Dockerfile", "local-images/prometheus.Dockerfile", "local-images/gateway.Dockerfile"]
DOCKERFILES = PROJECT_DOCKERFILES + LOCAL_DOCKERFILES
SECRET_WORDS = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|API_KEY|PRIVATE", re.I)


def _instructions(name: str) -> list[tuple[str, str]]:
    text = (REPO / "docker" / name).read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(deploy_tools, name):
    proc = subprocess.run([deploy_tools.hadolint, "--no-color", "--failure-threshold", "info", str(REPO / "docker" / name)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_what_it_should(deploy_tools, tmp_path):
    """The linter is live: a Dockerfile breaking the rules fails."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nENV API_TOKEN=abc\n")
    proc = subprocess.run([deploy_tools.hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3007" in proc.stdout  # latest


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_rules(name):
    ins = _instructions(name)
    args = dict(re.match(r"(\w+)(?:=(.*))?", rest).groups() for op, rest in ins if op == "ARG")
    froms = [rest.split()[0] for op, rest in ins if op == "FROM"]
    assert froms, "no FROM"
    for image in froms:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1)) or "", image)
        if image in {rest.split()[-1] for op, rest in ins if op == "FROM" and " AS " in rest.upper()}:
            continue  # a build stage
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "/" not in tag, f"{name}: base image {image!r} is not pinned"
    users = [rest for op, rest in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name}: the final user is root"
    assert re.fullmatch(r"\d+:\d+", users[-1]), f"{name}: USER should be numeric uid:gid, got {users[-1]}"
    assert any(op == "HEALTHCHECK" and rest.upper().startswith(("--", "CMD")) for op, rest in ins), f"{name}: no HEALTHCHECK"
    for op, rest in ins:
        if op in ("ENV", "ARG", "LABEL"):
            assert not SECRET_WORDS.search(rest), f"{name}: {op} {rest!r} looks like a secret baked into the image"
    assert not any(op == "ADD" for op, _ in ins), f"{name}: use COPY, not ADD"


def _stages(name: str) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for op, rest in _instructions(name):
        if op == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((op, rest))
    return stages


@pytest.mark.parametrize("name", PROJECT_DOCKERFILES)
def test_every_pip_install_takes_locked_hash_checked_files(name):
    """Nothing reaches an image by dependency resolution: each install is --no-deps, and each is
    hash-checked against a lock file except the project itself (from the build context) and the
    service image's torch from PyTorch's CPU index (no local wheel), pinned by version."""
    installs = [cmd.strip() for op, rest in _instructions(name) if op == "RUN"
                for cmd in re.split(r"&&|;|\bthen\b|\belse\b", rest) if re.search(r"\bpip install\b", cmd)]
    assert installs
    for cmd in installs:
        assert "--no-deps" in cmd, f"{name}: {cmd!r} resolves dependencies outside the lock"
        hashed = re.search(r"--require-hashes -r \S*constraints/(runtime|torch-cpu)\.lock\b", cmd)
        project = cmd.endswith(" .") and "--no-build-isolation" in cmd
        torch_by_version = '--index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"' in cmd
        assert hashed or project or torch_by_version, f"{name}: {cmd!r} installs something not hash-checked"
    assert any("constraints/runtime.lock" in cmd for cmd in installs), f"{name}: the runtime lock is not installed"


def test_service_image_takes_the_cpu_torch():
    text = (REPO / "docker" / "service.Dockerfile").read_text()
    pinned = re.search(r"^torch==(\S+)", (REPO / "constraints" / "cpu.txt").read_text(), re.M).group(1)
    assert f"ARG TORCH_VERSION={pinned}" in text, "the image's torch differs from constraints/cpu.txt"
    assert "download.pytorch.org/whl/cpu" in text and "--require-hashes -r /src/constraints/torch-cpu.lock" in text
    assert "pip check" in text


def test_trainer_image_is_built_in_stages_and_keeps_the_base_torch():
    build, final = _stages("trainer.Dockerfile")[-2:]
    base = "FROM ${TRAINER_BASE_IMAGE}"
    assert f"FROM {build[0][1]}".startswith(base + " ") and f"FROM {final[0][1]}" == base
    build_text = " ".join(rest for _, rest in build)
    assert "venv --system-site-packages" in build_text and "cmp - /tmp/torch-before" in build_text
    # the image itself: the base and the venv; no build CA certificates, wheels or pip run
    copies = [rest for op, rest in final if op in ("COPY", "ADD")]
    assert copies == ["--from=build /opt/asyncrl /opt/asyncrl"], copies
    final_text = " ".join(rest for _, rest in final)
    assert "pip" not in final_text and "ca-certificates" not in final_text and "/opt/local" not in final_text


def test_dockerignore_sends_only_the_sources():
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "**", "the context starts empty and whitelists sources (no .env, .git, .venv, runs, models)"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert not allowed & {".env", ".git", ".venv", "runs", "models", "docker"}
    for name in PROJECT_DOCKERFILES:
        for op, rest in _instructions(name):
            if op == "COPY" and "--from" not in rest:
                for src in rest.split()[:-1]:
                    assert src.rstrip("/") in allowed, f"{name}: COPY {src} is excluded by .dockerignore"


# -- docker/sglang/engine.sh: GPU slots for `--scale sglang=N` ---------------------------------
ENGINE = str(REPO / "docker" / "sglang" / "engine.sh")


def _engine(tmp_path, i: int, hold_s: float, **env) -> subprocess.Popen:
    base = {"PATH": "/usr/bin:/bin", "ENGINE_MODEL_PATH": "/models/m", "ENGINE_API_KEY": "engine-key-123",
            "ENGINE_SLOT_DIR": str(tmp_path / "slots"), "ENGINE_ADDR_FILE": str(tmp_path / f"addr{i}"),
            "ENGINE_DRY_RUN": "1", "ENGINE_DRY_RUN_HOLD_S": str(hold_s), "TMPDIR": str(tmp_path)}  # its secrets dir too
    return subprocess.Popen(["bash", ENGINE], env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_engine_replicas_claim_distinct_gpu_slots(tmp_path):
    env = {"ENGINE_GPUS": "0,1,2,3", "ENGINE_TP": "2", "ENGINE_PORT_PER_SLOT": "1"}
    first = [_engine(tmp_path, i, 4, **env) for i in range(2)]
    wait_for_sync(lambda: all((tmp_path / f"addr{i}").exists() for i in range(2)), 10, "both replicas to claim a slot",
                  procs=first, interval_s=0.05)
    third = _engine(tmp_path, 2, 0, **env)
    _, err3 = third.communicate(timeout=20)
    outs = [p.communicate(timeout=20) for p in first]
    assert third.returncode == 3 and "all 2 engine slots" in err3, err3
    visible = sorted(re.search(r"CUDA_VISIBLE_DEVICES=([\d,]+)\)", err).group(1) for _, err in outs)
    assert visible == ["0,1", "2,3"]
    ports = sorted((tmp_path / f"addr{i}").read_text().strip() for i in range(2))
    assert ports == ["127.0.0.1:30000", "127.0.0.1:30001"]
    assert all(p.returncode == 0 for p in first)
    # the locks died with the processes: a restarted replica gets a slot again
    again = _engine(tmp_path, 3, 0, **env)
    _, err = again.communicate(timeout=20)
    assert again.returncode == 0 and "slot 0 of 2" in err, err


def test_engine_refuses_a_bad_gpu_split(tmp_path):
    p = _engine(tmp_path, 0, 0, ENGINE_GPUS="0", ENGINE_TP="2")
    _, err = p.communicate(timeout=20)
    assert p.returncode == 2 and "fewer than ENGINE_TP" in err


# -- docker/gateway/default.conf: only the data plane goes out ---------------------------------
def test_gateway_forwards_only_the_data_plane():
    conf = (REPO / "docker" / "gateway" / "default.conf").read_text()
    conf = "\n".join(line.split("#", 1)[0] for line in conf.splitlines())
    locations = dict(re.findall(r"location\s+((?:=\s+)?\S+)\s*\{([^}]*)\}", conf))
    proxied = {loc for loc, body in locations.items() if "proxy_pass" in body}
    assert proxied == {"/v1/", "= /health"}, proxied
    assert "return 404" in locations["/"]
    assert re.search(r"upstream asyncrl_rollout\s*\{\s*server rollout:8000;", conf)
    assert "listen 8080;" in conf and "proxy_buffering off;" in locations["/v1/"]
    # every rollout route is under /v1/ (forwarded) or /admin (not), besides /health and /metrics
    src = {p: p.read_text() for p in (REPO / "rollout_service").rglob("*.py")}
    admin = [p for p, text in src.items() if 'APIRouter(prefix="/admin"' in text]
    assert admin, "the admin router moved: check what the gateway forwards"
    for path, text in src.items():
        for route in re.findall(r'@(?:router|app)\.(?:get|post|put|patch|delete)\("([^"]*)"', text):
            ok = route.startswith("/v1/") or route in ("/health", "/metrics") or path in admin
            assert ok, f"{path.relative_to(REPO)}: route {route} is neither data plane (/v1/) nor admin; update the gateway"


@pytest.mark.parametrize("name", PROJECT_DOCKERFILES)
def test_builds_take_local_wheels_and_ca_certificates(name):
    """Air-gapped builds: docker/local/ enters the build, its CAs are trusted and its wheels come first."""
    text = (REPO / "docker" / name).read_text()
    assert "COPY docker/local/ /opt/local/" in text
    assert "/opt/local/ca-certificates/*.crt" in text and "update-ca-certificates" in text
    assert "/opt/local/wheels" in text
    assert "!docker/local/" in (REPO / ".dockerignore").read_text()
    assert (REPO / "docker" / "local" / "README.md").is_file()  # the directory exists in a fresh clone


def test_local_stand_ins_pin_the_releases_compose_names():
    compose = (REPO / "compose.yaml").read_text()
    nats = re.search(r"NATS_IMAGE:-nats:([\d.]+)-alpine", compose).group(1)
    assert f"ARG NATS_VERSION={nats}" in (REPO / "docker" / "local-images" / "nats.Dockerfile").read_text()
    build = (REPO / "docker" / "build-local.sh").read_text()
    for name in LOCAL_DOCKERFILES:
        assert f"docker/{name}" in build, f"build-local.sh does not build {name}"
    for var in ("NATS_IMAGE", "PROMETHEUS_IMAGE", "GATEWAY_IMAGE", "PYTHON_IMAGE"):
        assert f"${{{var}:-" in compose and f"{var}=" in build, var
