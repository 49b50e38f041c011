"""compose.yaml's CPU profile, run for real under Docker: images built from local material
(docker/build-local.sh), the stack brought up with ``docker compose --profile cpu up``, the demo
trained by the deployment's own services, read back through the real Prometheus in its
container, and crashes of the trainer and rollout containers survived with nothing lost.

Its own command (it builds images and trains; about 15-25 minutes on 2 cores, most of it the
first image build and the demo model's warm-up): ``./dev test-deploy``. Under ``./dev test``
it is skipped unless ``ASYNCRL_DOCKER_TESTS=1``; with it set, a machine that cannot run Docker
skips with what is missing (tests/deploy/docker_engine.py), and everything else fails loudly.

A crash is a SIGKILL of the container's main process from the host (what the OOM killer or a
segfault does): Docker restarts the container by its restart policy. ``docker kill`` is not
used for that: Docker records it as a stop by hand and, by design, does not restart the
container (moby's restart manager honours ``ExitOnNext`` set by kill).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest

from asyncrl.launch import free_port
from asyncrl.models.smollm2 import cache_dir
from tests.deploy.conftest import REPO, make_secrets, parse_env_text
from tests.deploy.docker_engine import docker_engine

pytestmark = [pytest.mark.timeout(3600)]

BUILD_S = 2400.0  # first build on 2 cores: the base (debootstrap) and pip installing the service image
UP_S = 1200.0  # model-init (copies the shipped demo policy; ~2 min if it has to build it), then the first steps and syncs
PROGRESS_S = 600.0  # after a crash: restarted, recovered and two more steps
HEALTHY_S = 120.0  # the slowest healthcheck interval is 30 s (trainer)
POLL_S = 5.0
STOP_GRACE_S = 60  # docker compose stop's grace period before SIGKILL
DISCOVERY_S = 90.0  # Prometheus' DNS discovery of the engines (10 s refresh) and a scrape (10 s), with room
STEPS = 3  # trainer steps (and as many syncs) before the crash test
OPTIONAL = {"grafana", "nats-exporter", "json-exporter"}  # images no registry here provides
ENABLED = os.environ.get("ASYNCRL_DOCKER_TESTS") == "1"


def _run(argv: list[str], timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


class CpuStack:
    """The compose project of the CPU profile, with a test .env and the locally built images."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        # kept between runs (model-init skips the warm-up when it holds the same build)
        self.models = cache_dir() / "compose-cpu-models"
        self.models.mkdir(parents=True, exist_ok=True)
        # the operator's own tool writes them (docker/make-secrets.sh); compose mounts the files
        self.secrets = make_secrets(workdir / "secrets")
        text = (REPO / ".env.cpu.example").read_text()
        env = parse_env_text(text) | {
            "SECRETS_DIR": str(workdir / "secrets"),
            "MODELS_DIR": str(self.models),
            "RUN_CONFIG": str(REPO / "launcher" / "up" / "demo.toml"),
            "OPENAI_PORT": str(free_port()),
            "GRAFANA_PORT": str(free_port()),
        }
        self.env = env
        self.env_file = workdir / ".env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        self.images_env = REPO / "docker" / "local" / "images.env"
        self.started: list[str] = []

    def compose(self, *args: str, timeout: float = 120, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        argv = ["docker", "compose", "--project-directory", str(REPO), "-f", str(REPO / "compose.yaml"),
                "--env-file", str(self.env_file)]
        if self.images_env.is_file():
            argv += ["--env-file", str(self.images_env)]
        return _run([*argv, *args], timeout=timeout, check=check, input=input,
                    env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")})

    def services(self) -> list[str]:
        """The CPU profile's services whose images are here (built, loaded or pulled)."""
        project = json.loads(self.compose("config", "--format", "json").stdout)
        out = []
        for name, svc in project["services"].items():
            present = _run(["docker", "image", "inspect", svc["image"]], timeout=30, check=False).returncode == 0
            if present or name not in OPTIONAL:
                out.append(name)
        return out

    def container(self, service: str) -> str:
        ids = self.compose("ps", "--all", "-q", service).stdout.split()
        assert ids, f"no container for {service}"
        return ids[0]

    def inspect(self, service: str) -> dict:
        return json.loads(_run(["docker", "inspect", self.container(service)], timeout=30).stdout)[0]

    def promql(self, query: str) -> float | None:
        """The value of an instant query, asked of the real Prometheus inside its container."""
        url = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": query})
        proc = self.compose("exec", "-T", "prometheus", "wget", "-q", "-O", "-", url, timeout=30, check=False)
        if proc.returncode != 0:
            return None
        result = json.loads(proc.stdout)["data"]["result"]
        return max((float(r["value"][1]) for r in result), default=None)

    def targets(self, job: str) -> list[dict]:
        """Prometheus' active targets of ``job`` (``/api/v1/targets``): each one's scrape URL,
        health and last scrape error."""
        url = "http://127.0.0.1:9090/api/v1/targets?state=active"
        proc = self.compose("exec", "-T", "prometheus", "wget", "-q", "-O", "-", url, timeout=30, check=False)
        if proc.returncode != 0:
            return []
        return [t for t in json.loads(proc.stdout)["data"]["activeTargets"] if t["labels"].get("job") == job]

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", timeout=60, check=False).stdout[-12000:]


def _wait(what: str, stack: CpuStack, timeout: float, condition) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(POLL_S)
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n--- compose logs ---\n{stack.logs()}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not ENABLED:
        pytest.skip("runs Docker (builds images, trains; 15-25 min): its own command, ./dev test-deploy "
                    "(or ASYNCRL_DOCKER_TESTS=1)")
    missing = docker_engine()
    if missing is not None:
        pytest.skip(f"cannot run Docker here: {missing}")
    _run(["bash", "docker/build-local.sh"], timeout=BUILD_S)
    s = CpuStack(tmp_path_factory.mktemp("compose-cpu"))
    s.compose("down", "--volumes", "--remove-orphans", timeout=300, check=False)
    services = s.services()
    s.compose("up", "--detach", "--no-build", *services, timeout=UP_S)  # waits for model-init's warm-up
    s.started = services
    try:
        yield s
    finally:
        s.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300, check=False)


def _wait_scraped(stack: CpuStack, job: str, what: str) -> None:
    """Wait until Prometheus discovered ``job``'s targets and scraped every one successfully
    (discovery by DNS refreshes every 10 s: a slow start is waited for, up to DISCOVERY_S);
    a failure names each target and its last scrape error, or says none was discovered."""
    deadline = time.monotonic() + DISCOVERY_S
    seen: list[dict] = []
    while time.monotonic() < deadline:
        seen = stack.targets(job)
        if seen and all(t["health"] == "up" for t in seen) and stack.promql(f'min(up{{job="{job}"}})') == 1.0:
            return
        time.sleep(POLL_S)
    found = "; ".join(f"{t['scrapeUrl']}: {t['health']} ({t.get('lastError') or 'no error'})" for t in seen) \
        or "no target discovered"
    raise AssertionError(f"{what} are not scraped within {DISCOVERY_S:.0f} s: {found}\n--- compose logs ---\n{stack.logs()}")


def _step(stack: CpuStack) -> float:
    return stack.promql("asyncrl_trainer_global_step") or 0.0


def test_cpu_profile_trains_syncs_and_is_scraped(stack):
    _wait(f"{STEPS} trainer steps and {STEPS} weight syncs in Prometheus", stack, UP_S,
          lambda: _step(stack) >= STEPS and (stack.promql('asyncrl_sync_syncs_total{state="succeeded"}') or 0) >= STEPS)
    assert (stack.promql("asyncrl_rollout_publish_request_seconds_count") or 0) > 0, "the rollout service is not scraped"
    _wait_scraped(stack, "engines", "the CPU engines (DNS discovery of engine-cpu)")
    services = ("nats", "rollout", "sync-agent", "engine-cpu", "trainer-cpu", "prometheus", "gateway")
    _wait("every service healthy by its own healthcheck", stack, HEALTHY_S,
          lambda: all(stack.inspect(s)["State"].get("Health", {}).get("Status") == "healthy" for s in services))
    # the gateway publishes the OpenAI port and forwards /v1 only
    port = stack.env["OPENAI_PORT"]
    models = _run(["curl", "-s", "-H", f"Authorization: Bearer {stack.secrets['api_token']}", f"http://127.0.0.1:{port}/v1/models"], 30)
    assert "tiny-arith" in models.stdout or '"data"' in models.stdout, models.stdout
    admin = _run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://127.0.0.1:{port}/admin/status"], 30)
    assert admin.stdout == "404", f"the gateway forwarded an admin route: {admin.stdout}"


ASYNCRL_CONTAINERS = ("rollout", "sync-agent", "engine-cpu", "trainer-cpu", "python-sandbox")


def test_secrets_are_files_and_the_asyncrl_roots_are_read_only(stack):
    """Issue 30 item 8, under Docker: no container's configuration (``docker inspect``: what
    anyone with the Docker socket or a support bundle sees) holds a secret; the services read
    them from /run/secrets (they work: the run above trained, synced and was scraped with them);
    the asyncrl containers' roots are read-only: the service's user cannot change the installed
    code, and writes only to its volumes and /tmp."""
    values = set(stack.secrets.values())
    for service in stack.started:
        state = stack.inspect(service)
        env = state["Config"].get("Env") or []
        leaked = [e.split("=", 1)[0] for e in env if e.split("=", 1)[-1] in values]
        assert not leaked, f"{service}: secrets in its environment: {leaked}"
        assert not [a for a in state.get("Args", []) if a in values], f"{service}: a secret on its command line"
    for service in ASYNCRL_CONTAINERS:
        assert stack.inspect(service)["HostConfig"]["ReadonlyRootfs"] is True, service
    for service in ("rollout", "trainer-cpu", "engine-cpu"):
        code = "import pathlib, sys; p = pathlib.Path(sys.argv[1]); p.write_text('x')"
        for target, writable in (("/opt/asyncrl/lib/probe", False), ("/etc/probe", False), ("/tmp/probe", True)):
            proc = stack.compose("exec", "-T", service, "python", "-c", code, target, timeout=60, check=False)
            assert (proc.returncode == 0) == writable, f"{service}: writing {target}: exit {proc.returncode} {proc.stderr[-300:]}"
            if not writable:
                assert "Read-only file system" in proc.stderr, proc.stderr[-500:]
    # the secret files are there for the service that mounts them, readable by its user
    token = stack.compose("exec", "-T", "rollout", "cat", "/run/secrets/admin_token", timeout=60).stdout
    assert token == stack.secrets["admin_token"]


def test_grafana_loads_the_provisioned_dashboard(stack):
    if "grafana" not in stack.started:
        pytest.skip("no Grafana image here: compose.yaml's grafana/grafana cannot be pulled (no container registry) "
                    "and no Debian, PyPI or npm package ships Grafana; `docker load` it to run this check")
    port, password = stack.env["GRAFANA_PORT"], stack.secrets["grafana_admin_password"]
    url = f"http://admin:{password}@127.0.0.1:{port}/api/dashboards/uid/asyncrl-overview"
    _wait("Grafana's provisioned dashboard", stack, 180,
          lambda: '"uid":"asyncrl-overview"' in _run(["curl", "-s", url], 30, check=False).stdout)


def _crash(stack: CpuStack, service: str) -> int:
    """SIGKILL the container's main process from the host; returns the restart count before."""
    state = stack.inspect(service)
    _run(["kill", "-KILL", str(state["State"]["Pid"])], 30)
    return int(state["RestartCount"])


def _audit(stack: CpuStack) -> dict:
    """``asyncrl audit`` of the run, in a one-off trainer container on the compose network,
    over the trainer's run dir joined with the rollout service's published record."""
    run = "/var/lib/asyncrl/runs/demo"
    out = stack.workdir / "audit"
    if out.exists():
        _run(["rm", "-rf", str(out)], 30)
    out.mkdir()
    _run(["docker", "cp", f"{stack.container('trainer-cpu')}:{run}", str(out / "run")], 120)
    (out / "run" / "rollout").mkdir(exist_ok=True)
    _run(["docker", "cp", f"{stack.container('rollout')}:{run}/rollout/published.jsonl", str(out / "run" / "rollout")], 60)
    _run(["chmod", "-R", "a+rwX", str(out)], 30)
    password = stack.secrets["nats_trainer_password"]
    # plain `docker run` on the project's network: a `compose run` one-off would also answer to
    # the service's DNS name, which the engines and Prometheus resolve
    image = json.loads(stack.compose("config", "--format", "json").stdout)["services"]["trainer-cpu"]["image"]
    proc = _run(["docker", "run", "--rm", "--network", "asyncrl_default", "-v", f"{out}:/audit", image,
                 "audit", "/audit/run", "--run-id", "demo", "--nats", f"nats://trainer:{password}@nats:4222", "--json"],
                timeout=300, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"audit printed no result (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_killed_trainer_and_rollout_restart_and_nothing_is_lost(stack):
    save_freq = int(stack.env["CHECKPOINT_SAVE_FREQ"])
    _wait("a step after the first checkpoint", stack, UP_S, lambda: _step(stack) > save_freq)
    before = _step(stack)
    restarts = {service: _crash(stack, service) for service in ("trainer-cpu", "rollout")}
    _wait("both containers restarted by compose's restart policy", stack, 120,
          lambda: all(int(stack.inspect(s)["RestartCount"]) > n and stack.inspect(s)["State"]["Running"]
                      for s, n in restarts.items()))
    _wait("two more trainer steps after the crash", stack, PROGRESS_S, lambda: _step(stack) >= before + 2)
    audit = _audit(stack)
    shown = json.dumps(audit, indent=1)
    assert audit["ok"] and audit["lost"] == 0 and audit["twice"] == 0 and audit["lost_after_ack"] == 0, shown
    assert audit["checkpoint_step"] >= save_freq and audit["trained"] >= 1, shown


# Run inside the rollout container: send each probe (JSON on stdin) to the python-sandbox
# container through the rollout's own client, print the results as one JSON line.
_PROBE_DRIVER = """
import asyncio, json, os, sys
from tools.python_sandbox import PythonSandbox
async def main():
    box = PythonSandbox(sandbox_url=os.environ["ASYNCRL_ROLLOUT__PYTHON_SANDBOX_URL"])
    out = {}
    for name, code in json.load(sys.stdin).items():
        r = await box.call({"code": code}, timeout_s=20)
        out[name] = [r.content, r.metadata.get("isolation", {}).get("network"), r.metadata.get("isolation", {}).get("uid")]
    print(json.dumps(out))
asyncio.run(main())
"""


def test_the_python_tool_cannot_escape_its_sandbox_container(stack):
    """Issue 30 item 2, under Docker: the escape probes of tests/security/test_sandbox_escapes.py
    (a new interpreter by fork_exec, posix_spawn and subprocess reaching the rollout service's
    port, raw ctypes sockets, the service's environment and files, signals, the sandbox's own
    socket), sent by the rollout container to python-sandbox, all fail; each run has its own
    uid and no network."""
    import textwrap

    from tests.security.test_sandbox_escapes import probes

    rollout_ip = next(iter(stack.inspect("rollout")["NetworkSettings"]["Networks"].values()))["IPAddress"]
    programs = probes(8000, 1, "/var/lib/asyncrl/runs", "/run/asyncrl-sandbox/python.sock", host=rollout_ip)
    payload = json.dumps({name: textwrap.dedent(code) for name, (code, _ran) in programs.items()})
    proc = stack.compose("exec", "-T", "rollout", "python", "-c", _PROBE_DRIVER, timeout=300, check=False, input=payload)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"python-sandbox isolation: network {sorted({r[1] for r in results.values()})}")  # shown with -s
    escaped = {name: r for name, r in results.items() if "ESCAPED" in r[0]}
    assert not escaped, escaped
    assert all(r[1] in ("no_network", "namespace") and r[2] for r in results.values()), results
    did_not_run = {name: r[0] for name, r in results.items() if programs[name][1] not in r[0]}
    assert not did_not_run, f"probes that did not get as far as trying: {did_not_run}"


def test_services_stop_cleanly_on_sigterm(stack):
    """`docker compose stop` sends SIGTERM through the init (init: true) and each asyncrl
    service exits by itself well inside the grace period, not by the SIGKILL that follows it."""
    services = ("trainer-cpu", "rollout", "sync-agent", "engine-cpu")
    stack.compose("stop", "--timeout", str(STOP_GRACE_S), *services, timeout=300)
    for service in services:
        state = stack.inspect(service)["State"]
        assert not state["Running"] and state["ExitCode"] != 137, f"{service} was killed, not stopped: {state}"
