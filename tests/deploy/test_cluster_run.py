"""compose.cluster.yaml run for real: three nodes, each its own Docker engine on a private
network (tests/deploy/cluster_nodes.py), brought up the way docs/deployment.md's "Multi-node"
steps say, on the CPU roles (issue 54).

    node a  10.77.0.10  control + cpu-trainer + monitoring   nats, rollout, sync-agent, gateway,
                                                             python-sandbox, trainer-cpu, prometheus
    node b  10.77.0.11  cpu-engine                           engine-cpu (local_engine) on :30000
    node c  10.77.0.12  cpu-engine                           engine-cpu on :30000 (and :30001, scaled)

What the operator types is what runs: one ``.env`` from ``.env.cpu.example`` plus the per-node
lines of the docs, the secrets directory written once (docker/make-secrets.sh) and copied to
each node, the images loaded from the machine's engine (no registry: docker/build-local.sh's,
with its ``docker/local/images.env``), ``docker compose up -d`` on the engine nodes first, then
on node a; the run config is the demo's with more rollout steps (the test outlives 240 steps).

Checked: the run trains with trajectories from both engine nodes, gloo weight syncs across the
node network reach every engine and their ``/weights_checker`` checksums agree, Prometheus on
node a scrapes the trainer and every engine; bad starts (an address the network check refuses,
a missing secret file, an engine URL that does not answer) are refused naming the problem
while the cluster trains on; an engine node cut off the network: training goes on with the
other, the node's engine is repaired by a sync once it is back; the control node's rollout
service SIGKILLed while both engine nodes are cut off (agents held in flight): Docker restarts
it, it restores the agents, and they finish once the engines are back; ``asyncrl audit``: nothing lost or
trained twice; an engine added with ``--scale`` and ``/admin/engines`` joins at the next sync.

Its own command (root, Docker; ~5 min with the images built and loaded into the nodes, ~6.5 min
loading them, plus docker/build-local.sh's build the first time): ``./dev test-cluster``. Skipped under ``./dev test`` unless ``ASYNCRL_CLUSTER_TESTS=1``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest

from tests.deploy.cluster_nodes import Node, copy_tree, network_down, network_up, sh
from tests.deploy.conftest import REPO, make_secrets, parse_env_text
from tests.deploy.docker_engine import docker_engine

pytestmark = [pytest.mark.timeout(5400)]

ENABLED = os.environ.get("ASYNCRL_CLUSTER_TESTS") == "1"
ADDRS = {"a": "10.77.0.10", "b": "10.77.0.11", "c": "10.77.0.12"}
CONTROL = ADDRS["a"]
ENGINE_URLS = [f"http://{ADDRS['b']}:30000", f"http://{ADDRS['c']}:30000"]
SCALED_URL = f"http://{ADDRS['c']}:30001"
ABSENT_URL = "http://10.77.0.13:30000"  # an address on the network where nothing runs
BUILD_S = 2400.0
UP_S = 1200.0
PROGRESS_S = 600.0
REPAIR_S = 300.0
POLL_S = 3.0
STEPS = 3
RUN_ID = "demo"
NODE_A_SERVICES = ("network-check", "nats", "model-init", "rollout", "sync-agent", "python-sandbox", "gateway",
                   "trainer-cpu", "prometheus")
"""Node a's roles without Grafana and the two exporters: no registry here has their images
(docs/deployment.md, "Building without a container registry")."""
OPTIONAL = ("grafana", "nats-exporter", "json-exporter")


def node_env(name: str) -> dict[str, str]:
    """The node's .env: .env.cpu.example, then docs/deployment.md's lines for all nodes and for this one."""
    env = parse_env_text((REPO / ".env.cpu.example").read_text())
    env |= {
        "SECRETS_DIR": "./secrets",
        "RUN_CONFIG": "./cluster-run.toml",
        # all nodes
        "COMPOSE_FILE": "compose.yaml:compose.cluster.yaml",
        "CONTROL_ADDR": CONTROL,
        "MASTER_ADDR": CONTROL,
        "ENGINE_URLS": json.dumps(ENGINE_URLS, separators=(",", ":")),
        "ENGINE_ALLOWED_HOSTS": '["10.77.0.0/24"]',
        "NODE_ADDR": ADDRS[name],
        "COMPOSE_PROFILES": "control,cpu-trainer,monitoring" if name == "a" else "cpu-engine",
    }
    return env


class Cluster:
    """The three nodes and the run's secrets; helpers read the run the way an operator can."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes = {name: Node(name, addr, root / name / "asyncrl") for name, addr in ADDRS.items()}
        self.secrets: dict[str, str] = {}
        images = parse_env_text((REPO / "docker" / "local" / "images.env").read_text())
        self.images_a = [images[k] for k in ("ASYNCRL_SERVICE_IMAGE", "NATS_IMAGE", "PROMETHEUS_IMAGE", "GATEWAY_IMAGE")]
        self.images_engine = [images["ASYNCRL_SERVICE_IMAGE"]]

    @property
    def a(self) -> Node:
        return self.nodes["a"]

    def checkout(self, node: Node, env: dict[str, str] | None = None) -> None:
        """The node's clone, docker/local/images.env beside it, its .env and the run config."""
        copy_tree(REPO, node.workdir)
        (node.workdir / "docker" / "local").mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / "docker" / "local" / "images.env", node.workdir / "docker" / "local" / "images.env")
        env = env or node_env(node.name)
        (node.workdir / ".env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        demo = (REPO / "launcher" / "up" / "demo.toml").read_text()
        assert "total_rollout_steps = 960" in demo
        (node.workdir / "cluster-run.toml").write_text(demo.replace("total_rollout_steps = 960", "total_rollout_steps = 96000"))

    def compose(self, node: Node, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """docs/deployment.md's command on a machine without a registry: both env files."""
        return node.compose("--env-file", ".env", "--env-file", "docker/local/images.env", *args, timeout=timeout, check=check)

    def logs(self, node: Node | None = None, tail: int = 40) -> str:
        out = []
        for n in [node] if node else self.nodes.values():
            proc = self.compose(n, "logs", "--no-color", "--tail", str(tail), timeout=60, check=False)
            out.append(f"--- node {n.name} ---\n{proc.stdout[-6000:]}{proc.stderr[-1000:]}")
        return "\n".join(out)

    # ------------------------------------------------------------ reading the run ----
    def promql(self, query: str) -> float | None:
        """An instant query's largest value, asked of Prometheus in its container on node a."""
        return _max_value(self.prometheus("/api/v1/query?" + urllib.parse.urlencode({"query": query})))

    def prometheus(self, path: str) -> dict | None:
        proc = self.compose(self.a, "exec", "-T", "prometheus", "wget", "-q", "-O", "-", f"http://127.0.0.1:9090{path}",
                            timeout=30, check=False)
        return json.loads(proc.stdout)["data"] if proc.returncode == 0 else None

    def step(self) -> float:
        return self.promql("asyncrl_trainer_global_step") or 0.0

    def syncs(self) -> float:
        return self.promql('asyncrl_sync_syncs_total{state="succeeded"}') or 0.0

    def rollout_admin(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """An admin call to the rollout service as docs/deployment.md's "Admin routes" types it on
        a node without a registry: GNU wget in the rollout container (its port is not published)."""
        argv = ["exec", "-T", "rollout", "wget", "-q", "-S", "-O", "-", "--content-on-error",
                "--header", f"Authorization: Bearer {self.secrets['admin_token']}", "--header", "Content-Type: application/json"]
        if body is not None:
            argv += ["--post-data", json.dumps(body)]
        elif method != "GET":
            argv += [f"--method={method}"]
        proc = self.compose(self.a, *argv, f"http://127.0.0.1:8000{path}", timeout=120, check=False)
        codes = [line.split()[1] for line in proc.stderr.splitlines() if line.strip().startswith("HTTP/")]
        assert codes, f"no HTTP answer from the rollout service: {proc.stderr[-2000:]}"
        return int(codes[-1]), json.loads(proc.stdout)

    def engines(self) -> dict[str, dict]:
        """The rollout service's engines by URL (``/admin/status``)."""
        status, body = self.rollout_admin("GET", "/admin/status")
        assert status == 200, body
        return {e["url"]: e for e in body["engines"]}

    def engine_call(self, url: str, path: str, body: dict | None = None, timeout: float = 30) -> dict | None:
        """An engine route called from this machine over the nodes' network, with the engine key."""
        argv = ["curl", "-s", "-m", str(timeout), "-H", f"Authorization: Bearer {self.secrets['engine_api_key']}"]
        if body is not None:
            argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
        proc = sh([*argv, url + path], timeout=timeout + 10, check=False)
        try:
            return json.loads(proc.stdout) if proc.returncode == 0 else None
        except json.JSONDecodeError:
            return None

    def weight_version(self, url: str) -> int:
        """The engine's weight version (``/model_info``); -1 when it does not answer or still
        serves its start-up weights (``default``)."""
        version = str((self.engine_call(url, "/model_info") or {}).get("weight_version"))
        return int(version) if version.isdigit() else -1

    def audit(self) -> dict:
        """``asyncrl audit`` on node a over the trainer's run dir, the rollout's published record and the stream."""
        run = f"/var/lib/asyncrl/runs/{RUN_ID}"
        out = self.root / "audit"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        trainer = self.a.containers("trainer-cpu")[-1]["Id"]
        rollout = self.a.containers("rollout")[-1]["Id"]
        self.a.docker("cp", f"{trainer}:{run}", str(out / "run"), timeout=120)
        (out / "run" / "rollout").mkdir(exist_ok=True)
        self.a.docker("cp", f"{rollout}:{run}/rollout/published.jsonl", str(out / "run" / "rollout"), timeout=60)
        sh(["chmod", "-R", "a+rwX", str(out)])
        image = self.images_engine[0]
        proc = self.a.docker("run", "--rm", "--network", "asyncrl_default", "-v", f"{out}:/audit", image, "audit",
                             "/audit/run", "--run-id", RUN_ID, "--nats",
                             f"nats://trainer:{self.secrets['nats_trainer_password']}@nats:4222", "--json",
                             timeout=300, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        assert lines, f"audit printed no result (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        return json.loads(lines[-1])


def _max_value(data: dict | None) -> float | None:
    if not data:
        return None
    return max((float(r["value"][1]) for r in data["result"]), default=None)


def wait(what: str, cluster: Cluster, timeout: float, condition) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(POLL_S)
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{cluster.logs()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not ENABLED:
        pytest.skip("runs three Docker engines in network namespaces (root; ~5 min): its own command, "
                    "./dev test-cluster (or ASYNCRL_CLUSTER_TESTS=1)")
    missing = docker_engine()
    if missing is not None:
        pytest.skip(f"cannot run Docker here: {missing}")
    if os.geteuid() != 0:
        pytest.skip("the test nodes (network namespaces, a bridge, dockerd) need root")
    sh(["bash", "docker/build-local.sh"], timeout=BUILD_S, cwd=REPO)
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    network_up()
    try:
        for node in c.nodes.values():
            node.start()
            node.load_images(c.images_a if node.name == "a" else c.images_engine)
            c.checkout(node)
        # the secrets written once, on node a, and copied to the others (`scp -rp secrets nodeB:asyncrl/`)
        c.secrets = make_secrets(c.a.workdir / "secrets")
        for node in (c.nodes["b"], c.nodes["c"]):
            sh(["cp", "-rp", str(c.a.workdir / "secrets"), str(node.workdir / "secrets")])
        # Prometheus on node a: the engines of the other nodes
        (c.a.workdir / "docker" / "prometheus" / "targets" / "engines.json").write_text(json.dumps(
            [{"targets": [u.removeprefix("http://") for u in ENGINE_URLS], "labels": {"role": "engine"}}]))
        # engines first, then node a
        for name in ("b", "c"):
            c.compose(c.nodes[name], "up", "-d", "--no-build", timeout=UP_S)
        c.compose(c.a, "up", "-d", "--no-build", *NODE_A_SERVICES, timeout=UP_S)
        yield c
    finally:
        for node in c.nodes.values():
            if node.workdir.exists():
                c.compose(node, "down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300, check=False)
            node.stop()
        network_down()


def test_the_cluster_trains_with_engines_on_two_nodes_and_syncs_reach_both(cluster):
    wait(f"{STEPS} trainer steps and {STEPS} weight syncs (Prometheus on node a)", cluster, UP_S,
         lambda: cluster.step() >= STEPS and cluster.syncs() >= STEPS)
    # trajectories from the engines of both nodes
    wait("calls served by both engine nodes", cluster, PROGRESS_S,
         lambda: all(e["served"] > 0 for e in cluster.engines().values()))
    # every engine serves the same weights: same version and the same /weights_checker checksum
    def same_weights() -> bool:
        seen = []
        for url in ENGINE_URLS:
            before = cluster.weight_version(url)
            check = cluster.engine_call(url, "/weights_checker", {"action": "checksum"}, timeout=60) or {}
            seen.append((before, cluster.weight_version(url), check.get("per_engine_checksum")))
        if any(b != a or b < 0 for b, a, _ in seen) or len({v for v, _, _ in seen}) != 1:
            return False  # a sync landed between the reads: read again
        assert len({s for _, _, s in seen}) == 1 and seen[0][2], f"engines at one version serve different weights: {seen}"
        return True
    wait("both engines at one weight version", cluster, PROGRESS_S, same_weights)
    assert cluster.weight_version(ENGINE_URLS[0]) >= STEPS
    # Prometheus on node a scrapes the trainer (host network, MASTER_ADDR) and the engines of b and c
    def scraped() -> bool:
        targets = (cluster.prometheus("/api/v1/targets?state=active") or {}).get("activeTargets", [])
        ups = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in targets}
        want = {("trainer", "trainer:9400")} | {("engines", u.removeprefix("http://")) for u in ENGINE_URLS}
        return all(ups.get(k) == "up" for k in want)
    wait("Prometheus on node a scraping the trainer and both engine nodes", cluster, 120, scraped)


def _misconfigured(cluster: Cluster, name: str, env: dict[str, str], drop_secret: str | None = None) -> subprocess.CompletedProcess:
    """A second engine-node start on node c under its own project name, from its own checkout."""
    node = Node("c", ADDRS["c"], cluster.root / name / "asyncrl")
    cluster.checkout(node, env)
    sh(["cp", "-rp", str(cluster.a.workdir / "secrets"), str(node.workdir / "secrets")])
    if drop_secret:
        (node.workdir / "secrets" / drop_secret).unlink()
    up = cluster.compose(node, "-p", name, "up", "-d", "--no-build", timeout=UP_S, check=False)
    logs = cluster.compose(node, "-p", name, "logs", "--no-color", "network-check", timeout=60, check=False)
    cluster.compose(node, "-p", name, "down", "--volumes", "--timeout", "5", timeout=300, check=False)
    return subprocess.CompletedProcess(up.args, up.returncode, up.stdout + logs.stdout, up.stderr + logs.stderr)


def test_bad_node_starts_are_refused_naming_the_problem_and_the_cluster_trains_on(cluster):
    before = cluster.step()
    # an address that is not the node's own
    proc = _misconfigured(cluster, "bad-addr", node_env("c") | {"NODE_ADDR": "10.77.0.99"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NODE_ADDR" in out and "10.77.0.99" in out, out[-3000:]
    # a public address
    proc = _misconfigured(cluster, "bad-public", node_env("c") | {"CONTROL_ADDR": "8.8.8.8"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "CONTROL_ADDR" in out and "8.8.8.8" in out, out[-3000:]
    # a secret file missing on the node
    proc = _misconfigured(cluster, "bad-secret", node_env("c"), drop_secret="engine_api_key")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "engine_api_key" in out, out[-3000:]
    # an engine URL where nothing answers: refused, not registered
    status, body = cluster.rollout_admin("POST", "/admin/engines", {"url": ABSENT_URL})
    assert status == 409 and ABSENT_URL in body["error"]["message"], body
    assert ABSENT_URL not in cluster.engines()
    # the rest of the cluster went on
    wait("two more steps", cluster, PROGRESS_S, lambda: cluster.step() >= before + 2)
    assert set(cluster.engines()) == set(ENGINE_URLS)


def test_an_engine_node_cut_off_the_network_and_back(cluster):
    b = cluster.nodes["b"]
    lost, kept = ENGINE_URLS
    b.cut()
    try:
        wait("node b's engine out of rotation", cluster, 120, lambda: cluster.engines()[lost]["state"] != "healthy")
        cut_at, version_at_cut = cluster.step(), cluster.weight_version(kept)
        wait("two steps with node b gone", cluster, PROGRESS_S, lambda: cluster.step() >= cut_at + 2)
        wait("weight syncs reaching node c with node b gone", cluster, PROGRESS_S,
             lambda: cluster.weight_version(kept) > version_at_cut)
        served = cluster.engines()[kept]["served"]
        wait("node c serving alone", cluster, PROGRESS_S, lambda: cluster.engines()[kept]["served"] > served)
        synced_without_b = cluster.weight_version(kept)
    finally:
        b.restore()
    def repaired() -> bool:  # healthy, and at the weights node c serves, newer than those it missed
        return cluster.engines()[lost]["state"] == "healthy" \
            and cluster.weight_version(lost) == cluster.weight_version(kept) > synced_without_b
    wait("node b back, at the current weights after a sync", cluster, REPAIR_S, repaired)


def test_the_control_nodes_rollout_service_killed_restarts_and_its_agents_resume(cluster):
    """Agents are held in flight deterministically: both engine nodes cut off, no call can end.
    The rollout container's main process SIGKILLed then: Docker restarts it, it restores every
    checkpointed agent from NATS, and once the engines are back they finish and train."""
    engine_nodes = (cluster.nodes["b"], cluster.nodes["c"])
    for node in engine_nodes:
        node.cut()
    try:
        def held() -> bool:
            status, body = cluster.rollout_admin("GET", "/admin/status")
            return all(e["state"] != "healthy" for e in body["engines"]) and body["counts"]["active"] > 0
        wait("no engine in rotation, agents in flight", cluster, 120, held)
        state = cluster.a.containers("rollout")[-1]
        sh(["kill", "-KILL", str(state["State"]["Pid"])])
        wait("the rollout container restarted by its restart policy", cluster, 120,
             lambda: (s := cluster.a.containers("rollout")[-1])["RestartCount"] > state["RestartCount"]
             and s["State"]["Running"])
        def restored() -> int:
            try:
                return cluster.rollout_admin("GET", "/admin/status")[1]["counters"]["restored_agents"]
            except (AssertionError, KeyError, ValueError):
                return 0  # not answering yet
        wait("the restarted service restoring its agents", cluster, 180, lambda: restored() > 0)
    finally:
        for node in engine_nodes:
            node.restore()
    before = cluster.step()
    wait("two more steps with the engines back", cluster, PROGRESS_S, lambda: cluster.step() >= before + 2)
    audit = cluster.audit()
    shown = json.dumps(audit, indent=1)
    assert audit["ok"] and audit["lost"] == 0 and audit["twice"] == 0 and audit["lost_after_ack"] == 0, shown
    assert audit["trained"] >= 1, shown


def test_an_engine_scaled_out_and_registered_joins_at_the_next_sync(cluster):
    c = cluster.nodes["c"]
    cluster.compose(c, "up", "-d", "--no-build", "--no-recreate", "--scale", "engine-cpu=2", timeout=UP_S)
    wait("the second engine on node c answering on :30001", cluster, 300,
         lambda: sh(["curl", "-s", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}", f"{SCALED_URL}/health"],
                    check=False).stdout == "200")
    status, body = cluster.rollout_admin("POST", "/admin/engines", {"url": SCALED_URL})
    assert status == 200 and SCALED_URL in {e["url"] for e in body["engines"]}, body
    targets = cluster.a.workdir / "docker" / "prometheus" / "targets" / "engines.json"
    listed = json.loads(targets.read_text())
    listed[0]["targets"].append(SCALED_URL.removeprefix("http://"))
    targets.write_text(json.dumps(listed))
    at = cluster.weight_version(ENGINE_URLS[1])
    wait("the new engine at the weights of a sync after it joined, serving calls", cluster, REPAIR_S,
         lambda: cluster.weight_version(SCALED_URL) > at and cluster.engines()[SCALED_URL]["served"] > 0)
    def scraped() -> bool:
        targets = (cluster.prometheus("/api/v1/targets?state=active") or {}).get("activeTargets", [])
        return any(t["labels"]["instance"] == SCALED_URL.removeprefix("http://") and t["health"] == "up" for t in targets)
    wait("Prometheus scraping the new engine (file discovery, 30 s)", cluster, 120, scraped)
