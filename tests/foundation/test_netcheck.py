"""``python -m asyncrl.netcheck``: the cluster file's guard against running on addresses the
internet can reach (issue 30 item 8). Names resolve through a given resolver (no DNS here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl.netcheck import ALLOW_ENV, address_problem, main


def table(name: str) -> list[str]:
    known = {"node-a.internal": ["10.1.2.3"], "leaky.example": ["10.0.0.9", "203.0.113.200", "8.8.4.4"]}
    if name not in known:
        raise OSError(f"unknown host {name}")
    return known[name]


@pytest.mark.parametrize("value", ["10.0.0.5", "172.16.4.1", "192.168.1.20", "127.0.0.1", "fd00::17", "[fe80::1]",
                                   "100.101.102.103", "169.254.10.1", "node-a.internal"])
def test_private_addresses_pass(value):
    assert address_problem("NODE_ADDR", value, table) is None


@pytest.mark.parametrize(("value", "why"), [
    ("8.8.8.8", "public address (8.8.8.8)"),
    ("2001:4860:4860::8888", "public address"),
    ("leaky.example", "public address (8.8.4.4)"),  # one global address among private ones is enough
    ("nowhere.invalid", "does not resolve"),
    ("", "is empty"),
])
def test_public_unresolvable_or_empty_addresses_are_refused_naming_the_setting(value, why):
    problem = address_problem("CONTROL_ADDR", value, table)
    assert problem is not None and problem.startswith("CONTROL_ADDR") and why in problem


def test_the_command_fails_on_any_public_address_unless_allowed(capsys):
    assert main(["NODE_ADDR=10.0.0.5", "CONTROL_ADDR=10.0.0.6"], environ={}, resolver=table) == 0
    assert main(["NODE_ADDR=10.0.0.5", "MASTER_ADDR=8.8.8.8"], environ={}, resolver=table) == 1
    err = capsys.readouterr().err
    assert "MASTER_ADDR=8.8.8.8 is a public address" in err and ALLOW_ENV in err
    assert main(["MASTER_ADDR=8.8.8.8"], environ={ALLOW_ENV: "1"}, resolver=table) == 0
    assert "allowed by" in capsys.readouterr().err
    # the escape hatch is for public addresses only: an unresolvable one still fails
    assert main(["NODE_ADDR=nowhere.invalid"], environ={ALLOW_ENV: "1"}, resolver=table) == 1
    assert main(["NODE_ADDR"], environ={}, resolver=table) == 2


def test_it_runs_as_a_module():
    ok = subprocess.run([sys.executable, "-m", "asyncrl.netcheck", "NODE_ADDR=10.0.0.5"], capture_output=True, text=True,
                        timeout=60, env={"PATH": "/usr/bin:/bin"})
    bad = subprocess.run([sys.executable, "-m", "asyncrl.netcheck", "NODE_ADDR=1.1.1.1"], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert ok.returncode == 0 and "private" in ok.stdout
    assert bad.returncode == 1 and "NODE_ADDR=1.1.1.1 is a public address" in bad.stderr


@pytest.mark.parametrize("value", ["0.0.0.0", "::", "[::]", "0", "::ffff:0.0.0.0", "[::ffff:0:0]", "0:0:0:0:0:ffff:0.0.0.0"])
def test_the_unspecified_address_is_refused_even_when_public_ones_are_allowed(value):
    """Issue 48 item 3: 0.0.0.0, :: and "0" passed as private (not global), so CONTROL_ADDR=0.0.0.0
    published NATS and the sync agent on every interface, public ones too."""
    resolver = lambda name: {"0": ["0.0.0.0"]}[name]  # noqa: E731 - what getaddrinfo("0") answers
    problem = address_problem("CONTROL_ADDR", value, resolver)
    assert problem is not None and problem.startswith("CONTROL_ADDR") and "unspecified address" in problem
    assert main([f"CONTROL_ADDR={value}"], environ={ALLOW_ENV: "1"}, resolver=resolver) == 1


def test_this_node_setting_must_be_an_address_of_the_nodes_interfaces(capsys):
    """Issue 48 item 3 ("check the node's interfaces"): ``--this-node=NODE_ADDR`` fails when the
    address is on none of the node's interfaces, naming the setting and the addresses it has."""
    node = lambda: {"127.0.0.1", "10.1.2.3", "fe80::1"}  # noqa: E731 - the node's interfaces
    assert main(["--this-node=NODE_ADDR", "NODE_ADDR=10.1.2.3", "MASTER_ADDR=10.9.9.9"], environ={}, resolver=table,
                local=node) == 0
    assert main(["--this-node=NODE_ADDR", "NODE_ADDR=node-a.internal"], environ={}, resolver=table, local=node) == 0
    assert main(["--this-node=NODE_ADDR", "NODE_ADDR=10.1.2.4"], environ={ALLOW_ENV: "1"}, resolver=table,
                local=node) == 1
    err = capsys.readouterr().err
    assert "NODE_ADDR=10.1.2.4 is not an address of this node" in err and "10.1.2.3" in err
    assert main(["--this-node=CONTROL_ADDR", "NODE_ADDR=10.1.2.3"], environ={}, resolver=table, local=node) == 2


def test_this_node_check_reads_the_real_interfaces():
    """The check against this machine's own interfaces (psutil): loopback is one, TEST-NET-3 is not."""
    ok = subprocess.run([sys.executable, "-m", "asyncrl.netcheck", "--this-node=NODE_ADDR", "NODE_ADDR=127.0.0.1"],
                        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    bad = subprocess.run([sys.executable, "-m", "asyncrl.netcheck", "--this-node=NODE_ADDR", "NODE_ADDR=10.255.254.253"],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert ok.returncode == 0, ok.stderr
    assert bad.returncode == 1 and "is not an address of this node" in bad.stderr and "127.0.0.1" in bad.stderr
