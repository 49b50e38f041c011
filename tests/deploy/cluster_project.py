"""The asyncrl project on the three test nodes of tests/deploy/cluster_nodes.py, as an operator
drives it (tests/deploy/test_cluster_run.py): each node's checkout and ``.env`` (docs/deployment.md's
lines), ``docker compose`` with both env files, and the run read back the ways an operator can:
Prometheus on node a, the rollout service's admin routes (``awget``), the engines' own routes
over the private network, ``asyncrl audit``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

from tests.deploy.cluster_nodes import Node, copy_tree, sh
from tests.deploy.conftest import REPO, parse_env_text

ADDRS = {"a": "10.77.0.10", "b": "10.77.0.11", "c": "10.77.0.12"}
CONTROL = ADDRS["a"]
ENGINE_URLS = [f"http://{ADDRS['b']}:30000", f"http://{ADDRS['c']}:30000"]
RUN_ID = "demo"  # launcher/up/demo.toml's
POLL_S = 3.0
AWGET = ('exec wget -q -S -O - --content-on-error --header "Authorization: Bearer $(cat /run/secrets/admin_token)" "$@"')
"""docs/deployment.md's ``awget`` body (``sh -c`` in the rollout container)."""


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
        a node without a registry (``awget``): GNU wget in the rollout container (its port is not
        published), the admin token read there from its secret file, on no host command line."""
        argv = ["exec", "-T", "rollout", "sh", "-c", AWGET, "awget", "--header", "Content-Type: application/json"]
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
