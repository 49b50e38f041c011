"""Refuse to run a multi-node deployment on addresses the internet can reach (issue 30 item 8).

A cluster's control and training ports have no TLS, and some (the torchrun store, the weight
group, NCCL) no authentication at all (docs/security.md, "Ports"): they must stay on a private
network. ``compose.cluster.yaml`` starts ``python -m asyncrl.netcheck`` with the addresses it
publishes or host-networks (``NODE_ADDR``, ``CONTROL_ADDR``, ``MASTER_ADDR``) before any other
service of the node; every other service waits for it to succeed.

Contract of :func:`address_problem`: an address is acceptable when every address it resolves
to is not globally routable (:attr:`ipaddress.IPv4Address.is_global` false: RFC 1918,
loopback, link-local, unique-local IPv6, and the shared 100.64.0.0/10 space VPN overlays such
as Tailscale use); a name that does not resolve, an empty value, or any global address is a
problem, named with its setting, and so is the unspecified address (``0.0.0.0``, ``::``,
``0``: every interface, the public ones too; issue 48), never "private" whatever
``NETCHECK_ALLOW_PUBLIC`` says. ``NETCHECK_ALLOW_PUBLIC=1`` accepts global addresses
(for a network its owner has otherwise closed: a firewall that admits only the nodes), saying
so on stderr. ``--this-node=SETTING`` (compose passes ``NODE_ADDR``) also checks the node's
interfaces: that setting's address must be one of them (:func:`node_problem`), else the
services that bind it (engines, the trainer's stores) could not, or a typo would point the
peers at another machine. Not covered: whether the private network is in fact trusted.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import Callable, Sequence

ALLOW_ENV = "NETCHECK_ALLOW_PUBLIC"

Resolver = Callable[[str], list[str]]


def resolve(name: str) -> list[str]:
    """Every address ``name`` resolves to (an IP literal resolves to itself)."""
    return sorted({info[4][0] for info in socket.getaddrinfo(name, None)})


def plain_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``text`` as an address, an IPv4-mapped IPv6 one (``::ffff:0.0.0.0``, in any spelling) as
    the IPv4 address it maps (issue 67 L5: the mapped unspecified address passed the check and
    listened on every IPv4 interface). Raises ValueError for what is not an address."""
    address = ipaddress.ip_address(text.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def address_problem(setting: str, value: str, resolver: Resolver = resolve) -> str | None:
    """Why ``value`` (the setting named ``setting``) is not a private address, or None."""
    host = value.strip().strip("[]")
    if not host:
        return f"{setting} is empty: set it to this node's private address"
    try:
        addresses = [plain_address(host)]
    except ValueError:
        try:
            addresses = [plain_address(a) for a in resolver(host)]
        except OSError as exc:
            return f"{setting}={value} does not resolve ({exc}): give a private address"
    unspecified = [str(a) for a in addresses if a.is_unspecified]
    if unspecified:  # 0.0.0.0, ::, "0": every interface, the public ones too
        return (f"{setting}={value} is the unspecified address ({', '.join(unspecified)}): a port published or bound "
                f"there listens on every interface of the node, its public ones too; give this node's private address")
    public = [str(a) for a in addresses if a.is_global]
    if public:
        return (f"{setting}={value} is a public address ({', '.join(public)}): the cluster's NATS, sync-agent, "
                f"torchrun and NCCL ports would be reachable from the internet without TLS; use the nodes' "
                f"private network (or a VPN), or set {ALLOW_ENV}=1 if a firewall admits only the nodes")
    return None


def local_addresses() -> set[str]:
    """Every address on this node's interfaces."""
    import psutil

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


def node_problem(setting: str, value: str, resolver: Resolver = resolve,
                 local: Callable[[], set[str]] = local_addresses) -> str | None:
    """Why ``value`` is not an address of this node's interfaces, or None."""
    host = value.strip().strip("[]")
    try:
        wanted = {str(ipaddress.ip_address(host))}
    except ValueError:
        try:
            wanted = {a.split("%")[0] for a in resolver(host)}
        except OSError:
            return None  # address_problem names it
    have = {str(ipaddress.ip_address(a)) for a in local()}
    if wanted & have:
        return None
    return (f"{setting}={value} is not an address of this node (its interfaces have {', '.join(sorted(have))}): "
            f"the engines and the trainer bind it; give this node's private address")


def main(argv: Sequence[str], environ=os.environ, resolver: Resolver = resolve,
         local: Callable[[], set[str]] = local_addresses) -> int:
    """``python -m asyncrl.netcheck [--this-node=SETTING] SETTING=VALUE ...``: 0 when every address
    is private (or public ones are allowed) and the ``--this-node`` ones are this node's, else 1
    with one line per problem on stderr; 2 on bad usage."""
    own = {a.split("=", 1)[1] for a in argv if a.startswith("--this-node=")}
    pairs = [a.split("=", 1) for a in argv if not a.startswith("--this-node=")]
    if not pairs or any(len(p) != 2 for p in pairs) or own - {p[0] for p in pairs}:
        print("usage: python -m asyncrl.netcheck [--this-node=SETTING] SETTING=ADDRESS [SETTING=ADDRESS ...]",
              file=sys.stderr)
        return 2
    problems = [p for setting, value in pairs if (p := address_problem(setting, value, resolver))]
    misplaced = [p for setting, value in pairs if setting in own and (p := node_problem(setting, value, resolver, local))]
    for p in misplaced:
        print("asyncrl netcheck: " + p, file=sys.stderr)
    if not problems and not misplaced:
        print("asyncrl netcheck: " + ", ".join(f"{s}={v}" for s, v in pairs) + ": private")
        return 0
    allowed = environ.get(ALLOW_ENV, "") in ("1", "true", "yes")
    for p in problems:
        print(("asyncrl netcheck (allowed by " + ALLOW_ENV + "): " if allowed else "asyncrl netcheck: ") + p, file=sys.stderr)
    return 0 if not misplaced and allowed and all("public address" in p for p in problems) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
