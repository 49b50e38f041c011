"""Three test hosts on one machine, for the multi-node compose run (tests/deploy/test_cluster_run.py).

A :class:`Node` is what a cluster node is to compose: its own Docker engine, its own network
stack with one private address, and its own directory (a copy of the repository, its ``.env``,
its secrets and models). Built from the kernel's own parts, as root:

- a network namespace per node (``ip netns add asyncrl-<name>``) whose ``eth0`` is one end of
  a veth pair; the other ends hang on a bridge in the machine's namespace (``BRIDGE``, the
  private network ``SUBNET``.0/24; the machine itself is ``HOST_ADDR`` on it, the way an
  operator's workstation is on a cluster's network);
- a ``dockerd`` started inside that namespace (``nsenter --net=...``: ``ip netns exec`` remounts
  /sys, which hides the devices cgroup dockerd needs) with its own data root, exec root and
  socket; its iptables rules (NAT for its bridge networks, published ports) live in the
  namespace, so the nodes' Docker networks do not meet;
- images loaded from the machine's own Docker engine (``docker save | docker load``: no
  registry) into the node's data root (``STATE``, ~5 GB a node). :meth:`Node.forget` removes
  it after the run: the disk is shared with the suite, whose NATS servers size their stores by
  the free space (a kept 16 GB once failed CI). ``ASYNCRL_CLUSTER_KEEP_IMAGES=1`` keeps it for
  the next run (images reloaded only when the built one changed, the replaced ones pruned).

Faults: :meth:`Node.cut` takes the node's link down (the node is gone for everyone else, its
containers keep running), :meth:`Node.restore` brings it back.

Limits: one machine's kernel, CPUs and clock for all nodes (their ``hostname`` is the
machine's); Docker's FORWARD policy on the machine is DROP with ``br_netfilter`` on, so the
bridge gets an ACCEPT rule of its own (removed with it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

BRIDGE = "asyncrl-cl0"
SUBNET = "10.77.0"
HOST_ADDR = f"{SUBNET}.1"
STATE = Path("/var/lib/asyncrl-cluster")  # each node's Docker data root (its loaded images)
KEEP_IMAGES = os.environ.get("ASYNCRL_CLUSTER_KEEP_IMAGES") == "1"
RUN = Path("/run/asyncrl-cluster")  # sockets, pid files, exec roots
DOCKERD_START_S = 90.0
FORWARD_RULE = ["FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]


def sh(argv: list[str], timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run ``argv``; with ``check`` a non-zero exit (or the timeout) raises, without it the
    timeout is exit status 124 (clean-up steps go on past a hung command)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as exc:
        if check:
            raise
        return subprocess.CompletedProcess(argv, 124, str(exc.stdout or ""), f"timed out after {timeout} s")
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def network_up() -> None:
    """The private network's bridge, with the machine at HOST_ADDR (idempotent)."""
    if sh(["ip", "link", "show", BRIDGE], check=False).returncode != 0:
        sh(["ip", "link", "add", BRIDGE, "type", "bridge"])
        sh(["ip", "addr", "add", f"{HOST_ADDR}/24", "dev", BRIDGE])
    sh(["ip", "link", "set", BRIDGE, "up"])
    if sh(["iptables", "-C", *FORWARD_RULE], check=False).returncode != 0:
        sh(["iptables", "-I", *FORWARD_RULE])


def network_down() -> None:
    sh(["iptables", "-D", *FORWARD_RULE], check=False)
    sh(["ip", "link", "del", BRIDGE], check=False)


def copy_tree(repo: Path, target: Path) -> None:
    """What a clone of ``repo`` holds, with its uncommitted changes (the files git tracks or
    would add): the node's checkout."""
    names = sh(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]).stdout
    for name in filter(None, names.split("\0")):
        source = repo / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


class Node:
    """One test host: a network namespace with ``addr``, a dockerd, a directory ``workdir``."""

    def __init__(self, name: str, addr: str, workdir: Path) -> None:
        self.name = name
        self.addr = addr
        self.workdir = workdir
        self.netns = f"asyncrl-{name}"
        self.veth = f"acl-{name}"
        self.sock = RUN / f"{name}.sock"
        self.pidfile = RUN / f"{name}.pid"
        self.log = RUN / f"{name}-dockerd.log"
        self.env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
                    "DOCKER_HOST": f"unix://{self.sock}"}
        self._daemon: subprocess.Popen | None = None

    # ------------------------------------------------------------------ set-up ----
    def start(self) -> None:
        """The namespace, its link on the bridge and its dockerd (waits until it answers)."""
        RUN.mkdir(parents=True, exist_ok=True)
        self.stop()
        sh(["ip", "netns", "add", self.netns])
        sh(["ip", "link", "add", self.veth, "type", "veth", "peer", "name", f"{self.veth}-in"])
        sh(["ip", "link", "set", f"{self.veth}-in", "netns", self.netns])
        sh(["ip", "link", "set", self.veth, "master", BRIDGE, "up"])
        inside = ["ip", "-n", self.netns]
        sh([*inside, "link", "set", f"{self.veth}-in", "name", "eth0"])
        sh([*inside, "addr", "add", f"{self.addr}/24", "dev", "eth0"])
        sh([*inside, "link", "set", "eth0", "up"])
        sh([*inside, "link", "set", "lo", "up"])
        sh([*inside, "route", "add", "default", "via", HOST_ADDR])
        data_root = STATE / self.name
        data_root.mkdir(parents=True, exist_ok=True)
        log = open(self.log, "ab")  # noqa: SIM115 (handed to the daemon)
        self._daemon = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.netns}", "dockerd", "--data-root", str(data_root), "--exec-root",
             str(RUN / f"{self.name}-exec"), "--pidfile", str(self.pidfile), "-H", f"unix://{self.sock}"],
            stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + DOCKERD_START_S
        while time.monotonic() < deadline:
            if self.docker("info", check=False, timeout=20).returncode == 0:
                return
            time.sleep(1.0)
        raise AssertionError(f"node {self.name}: dockerd did not answer within {DOCKERD_START_S:.0f} s "
                             f"({self.log}):\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """Its containers and dockerd stopped, its namespace and link removed (the data root stays)."""
        if self.sock.exists() and self.docker("info", check=False, timeout=20).returncode == 0:
            ids = self.docker("ps", "-aq", check=False).stdout.split()
            if ids:
                self.docker("rm", "-f", *ids, check=False, timeout=120)
        pids = {int(self.pidfile.read_text().strip() or 0)} if self.pidfile.exists() else set()
        if self._daemon is not None and self._daemon.poll() is None:
            pids.add(self._daemon.pid)  # started but no pid file yet
        for pid in pids - {0}:
            sh(["kill", "-TERM", str(pid)], check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.5)
            sh(["kill", "-KILL", str(pid)], check=False)
        # the containerd a dockerd manages goes with it on TERM, not on KILL
        sh(["pkill", "-KILL", "-f", str(RUN / f"{self.name}-exec")], check=False)
        self.pidfile.unlink(missing_ok=True)
        if self._daemon is not None:
            self._daemon.poll()  # reaped: it was this process's child
        sh(["ip", "link", "del", self.veth], check=False)
        sh(["ip", "netns", "del", self.netns], check=False)

    def load_images(self, refs: list[str]) -> None:
        """Each image of the machine's engine into this node's, unless it has the same one."""
        missing = []
        for ref in refs:
            want = sh(["docker", "image", "inspect", "-f", "{{.Id}}", ref]).stdout.strip()
            have = self.docker("image", "inspect", "-f", "{{.Id}}", ref, check=False).stdout.strip()
            if have != want:
                missing.append(ref)
        if not missing:
            return
        save = subprocess.Popen(["docker", "save", *missing], stdout=subprocess.PIPE)
        load = subprocess.run(["docker", "load"], stdin=save.stdout, capture_output=True, text=True, timeout=1200,
                              env=self.env)
        save.stdout.close()
        assert save.wait(timeout=60) == 0 and load.returncode == 0, f"node {self.name}: loading {missing}: {load.stderr[-2000:]}"
        self.docker("image", "prune", "-f", check=False, timeout=300)  # the images the new ones replaced

    def forget(self) -> None:
        """Its data root removed (after :meth:`stop`), unless ``ASYNCRL_CLUSTER_KEEP_IMAGES=1``."""
        if KEEP_IMAGES:
            return
        data_root = STATE / self.name
        shutil.rmtree(data_root, ignore_errors=True)
        if data_root.exists():  # a mount left by a dockerd that had to be killed: say so, it holds GBs
            left = sh(["du", "-sh", str(data_root)], check=False).stdout.strip()
            raise AssertionError(f"node {self.name}: its data root could not be removed ({left}); "
                                 f"unmount what is under it and remove it by hand")

    # ------------------------------------------------------------------- using ----
    def docker(self, *args: str, timeout: float = 120, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        return sh(["docker", *args], timeout=timeout, check=check, input=input, env=self.env)

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """``docker compose`` run in the node's checkout with its ``.env`` (what the operator
        types on the node)."""
        return sh(["docker", "compose", *args], timeout=timeout, check=check, env=self.env, cwd=self.workdir)

    def inside(self, *argv: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
        """A command in the node's network namespace (curl from the node itself)."""
        return sh(["nsenter", f"--net=/run/netns/{self.netns}", *argv], timeout=timeout, check=check)

    def containers(self, service: str) -> list[dict]:
        """``docker inspect`` of each container of ``service`` (compose's label), oldest first."""
        ids = self.docker("ps", "-aq", "--filter", f"label=com.docker.compose.service={service}").stdout.split()
        if not ids:
            return []
        return sorted(json.loads(self.docker("inspect", *ids).stdout), key=lambda c: c["Created"])

    def cut(self) -> None:
        """The node's link down: it is unreachable, its containers keep running."""
        sh(["ip", "link", "set", self.veth, "down"])

    def restore(self) -> None:
        sh(["ip", "link", "set", self.veth, "up"])
