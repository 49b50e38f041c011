"""A real network partition on loopback for fault tests: iptables DROP rules on chosen TCP
ports (RELIABILITY.md F11 "iptables DROP on NCCL ports"). Dropped, not refused: the peers see
no reset, their bytes just stop arriving, as across a partitioned network.

Needs root and ``iptables``. :func:`iptables_or_skip` installs Debian's ``iptables`` when the
machine allows it (root, ``apt-get``, a reachable Debian mirror; bounded), else skips the test
naming what is missing. Rules are inserted at the top of INPUT for ``-i lo`` only and always
removed by :class:`Partition` (a context manager), so nothing outlives the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

INSTALL_TIMEOUT_S = 300.0
RULE_TIMEOUT_S = 30.0


def iptables_or_skip() -> str:
    """The ``iptables`` binary, installed first if the machine allows it; skips otherwise."""
    if os.geteuid() != 0:
        pytest.skip("a real partition needs root (iptables DROP rules); this run is not root")
    found = shutil.which("iptables")
    if found is None and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "iptables"], capture_output=True, timeout=INSTALL_TIMEOUT_S,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        found = shutil.which("iptables")
    if found is None:
        pytest.skip("a real partition needs iptables: `apt-get install iptables` failed or there is no apt-get")
    probe = subprocess.run([found, "-L", "INPUT", "-n"], capture_output=True, text=True, timeout=RULE_TIMEOUT_S)
    if probe.returncode != 0:
        pytest.skip(f"iptables cannot change this kernel's rules: {probe.stderr.strip()[:200]}")
    return found


class Partition:
    """DROP every loopback TCP segment to or from ``ports`` while active."""

    def __init__(self, iptables: str, ports: list[int]) -> None:
        self.iptables = iptables
        self.rules = [["INPUT", "-i", "lo", "-p", "tcp", f"--{side}", str(p), "-j", "DROP"]
                      for p in sorted(set(ports)) for side in ("sport", "dport")]
        self.active = False

    def _run(self, op: str, rule: list[str]) -> None:
        subprocess.run([self.iptables, op, *rule], check=True, capture_output=True, timeout=RULE_TIMEOUT_S)

    def cut(self) -> None:
        for rule in self.rules:
            self._run("-I", rule)
        self.active = True

    def heal(self) -> None:
        if self.active:
            for rule in self.rules:
                self._run("-D", rule)
            self.active = False

    def __enter__(self) -> Partition:
        self.cut()
        return self

    def __exit__(self, *exc) -> None:
        self.heal()
