"""Where a rendezvous listens: on the master address, never on every interface (issue 48 item 3).

The trainer hosts unauthenticated TCP ports: torchrun's rendezvous store (29500), the
weight-update group's store (29600) and the gloo/NCCL connections behind them. Bound to all
interfaces, a dual-homed node would serve them on its public interface while ``MASTER_ADDR``
is private. This module is the one place that decides the address:

- :func:`reserve_listen_socket` ``(address, port)`` binds and listens **on** ``address``: a
  loopback address (or ``localhost``) binds 127.0.0.1; any other name or IP is resolved and the
  socket binds the first resolved address that belongs to this host. None does (a name that
  resolves to another machine, a NAT address): :class:`ListenAddressError`, naming the address
  and what to set; the unspecified address (``0.0.0.0``, ``::``) is refused outright.
- :func:`interface_of` ``(ip)``: the network interface that carries ``ip`` on this host.
- :func:`socket_ifname_env` ``(master_address)``: ``GLOO_SOCKET_IFNAME`` and
  ``NCCL_SOCKET_IFNAME`` for the interface this host reaches the master address through (``lo``
  for a loopback master), for the variables the environment does not set already: gloo's and
  NCCL's own listening sockets then sit on that interface only.
- :func:`bound_ifname_env` ``(host)``: the same variables for a server bound to one address of
  this host (an engine listening on its node's address joins the weight group from there).

Not covered: IPv6 link-local addresses with a zone id (give an address without one); which
network is private is :mod:`asyncrl.netcheck`'s question, not this module's. A host *name* that
resolves here to a loopback address only (Debian's ``127.0.1.1 <hostname>`` line) is bound
there, which other hosts cannot reach: a warning says so; on more than one node give the
node's address (``trainer.master_addr``).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Mapping

import psutil

from asyncrl.netcheck import plain_address

log = logging.getLogger(__name__)

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class ListenAddressError(OSError):
    """The master address cannot be listened on from this host (message says why and what to set)."""


def is_loopback(address: str) -> bool:
    """True for ``localhost`` and loopback IPs (127.0.0.0/8, ::1)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def _candidates(address: str) -> list[tuple[int, str]]:
    host = address.strip().strip("[]")
    if not host:
        raise ListenAddressError("the master address is empty: give this node's address that the peers reach")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ListenAddressError(f"the master address {address!r} does not resolve here ({exc})") from exc
    out: list[tuple[int, str]] = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        if plain_address(ip).is_unspecified:
            raise ListenAddressError(f"the master address {address!r} is the unspecified address ({ip}): a port there "
                                     f"listens on every interface, the public ones too; give this node's address")
        if (family, ip) not in out:
            out.append((family, ip))
    out.sort(key=lambda c: c[0] != socket.AF_INET)  # IPv4 first, as torch's own stores prefer
    return out


def reserve_listen_socket(address: str, port: int = 0) -> socket.socket:
    """Bind and listen on ``address``:``port`` before announcing it (``port=0``: pick one).

    Contract in the module docstring. Pass the socket to a ``TCPStore`` as ``master_listen_fd``
    (or to :func:`asyncrl.weight_sync.host_group`); read the port with ``sock.getsockname()[1]``."""
    candidates = [(socket.AF_INET, "127.0.0.1")] if is_loopback(address) else _candidates(address)
    if not is_loopback(address) and all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for _, ip in candidates):
        log.warning("the master address %r resolves to %s on this host, a loopback address: peers on other hosts cannot "
                    "reach it there; give this node's address (trainer.master_addr) for a run on more than one host",
                    address, ", ".join(ip for _, ip in candidates))
    refused: list[str] = []
    for family, ip in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
            sock.listen(128)
            return sock
        except OSError as exc:
            sock.close()
            if port and exc.errno not in (99,):  # EADDRINUSE and the like: the port, not the address
                raise
            refused.append(f"{ip} ({exc.strerror or exc})")
    raise ListenAddressError(
        f"the master address {address!r} resolves to {', '.join(refused)}, none an address of this host: the "
        f"trainer's rendezvous and weight-group ports listen on the master address only; set trainer.master_addr "
        f"(MASTER_ADDR) to this node's address on the network the peers reach")


def interface_of(ip: str) -> str | None:
    """The interface that carries ``ip`` on this host, or None."""
    want = ipaddress.ip_address(ip.split("%")[0])
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(a.address.split("%")[0]) == want:
                        return name
                except ValueError:
                    continue
    return None


def route_source(address: str) -> str | None:
    """This host's address on the route to ``address`` (a UDP ``connect``: nothing is sent), or None."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address.strip("[]"), 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError:
        return None


def socket_ifname_env(master_address: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` values to add (those ``environ`` lacks):
    the interface of this host's route to ``master_address``; empty when it cannot be told."""
    if is_loopback(master_address):
        name: str | None = "lo"
    else:
        source = route_source(master_address)
        name = interface_of(source) if source else None
    return _unset_ifname_vars(name, environ)


def bound_ifname_env(host: str, environ: Mapping[str, str]) -> dict[str, str]:
    """For a server bound to one address of this host (an engine on ``NODE_ADDR``): the
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` values to add (those ``environ`` lacks),
    naming the interface that carries ``host``, so the weight group's connections it joins
    listen where its peers reach it, not on what the host name resolves to (often
    ``127.0.1.1``). Empty for loopback, the unspecified address, a name, or an address no
    interface carries."""
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return {}
    if ip.is_loopback or ip.is_unspecified:
        return {}
    return _unset_ifname_vars(interface_of(str(ip)), environ)


def _unset_ifname_vars(name: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """``name`` for each of :data:`IFNAME_VARIABLES` that ``environ`` does not set (none without a name)."""
    return {var: name for var in IFNAME_VARIABLES if not environ.get(var)} if name else {}
