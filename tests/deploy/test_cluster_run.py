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

import contextlib
import json
import os
import subprocess

import pytest

from tests.deploy.cluster_nodes import Node, network_down, network_up, sh
from tests.deploy.cluster_project import ADDRS, ENGINE_URLS, Cluster, node_env, wait
from tests.deploy.conftest import REPO, ROLE_SECRETS, make_secrets
from tests.deploy.docker_engine import docker_engine

pytestmark = [pytest.mark.timeout(5400)]

ENABLED = os.environ.get("ASYNCRL_CLUSTER_TESTS") == "1"
SCALED_URL = f"http://{ADDRS['c']}:30001"
ABSENT_URL = "http://10.77.0.13:30000"  # an address on the network where nothing runs
BUILD_S = 2400.0
UP_S = 1200.0
PROGRESS_S = 600.0
REPAIR_S = 300.0
STEPS = 3
NODE_A_SERVICES = ("network-check", "nats", "model-init", "rollout", "sync-agent", "python-sandbox", "gateway",
                   "trainer-cpu", "prometheus")
"""Node a's roles without Grafana and the two exporters: no registry here has their images
(docs/deployment.md, "Building without a container registry")."""


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
        # the secrets written once, on node a; the engine nodes get only the engine key, as
        # docs/deployment.md's table says (issue 67 L7)
        c.secrets = make_secrets(c.a.workdir / "secrets")
        for node in (c.nodes["b"], c.nodes["c"]):
            (node.workdir / "secrets").mkdir(mode=0o700)
            for name in sorted(ROLE_SECRETS["cpu-engine"]):
                sh(["cp", "-p", str(c.a.workdir / "secrets" / name), str(node.workdir / "secrets" / name)])
        # Prometheus on node a: the engines of the other nodes
        (c.a.workdir / "docker" / "prometheus" / "targets" / "engines.json").write_text(json.dumps(
            [{"targets": [u.removeprefix("http://") for u in ENGINE_URLS], "labels": {"role": "engine"}}]))
        # engines first, then node a
        for name in ("b", "c"):
            c.compose(c.nodes[name], "up", "-d", "--no-build", timeout=UP_S)
        c.compose(c.a, "up", "-d", "--no-build", *NODE_A_SERVICES, timeout=UP_S)
        yield c
    finally:  # each step runs whatever the others did (ExitStack): no node, link or rule is left behind
        with contextlib.ExitStack() as cleanup:  # last in, first out
            cleanup.callback(network_down)
            for node in c.nodes.values():
                cleanup.callback(node.forget)
                cleanup.callback(node.stop)
                if node.workdir.exists() and node.sock.exists():
                    cleanup.callback(c.compose, node, "down", "--volumes", "--remove-orphans", "--timeout", "20",
                                     timeout=300, check=False)


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
