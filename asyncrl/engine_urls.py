"""Which engine URLs may receive the engine keys: the engines of the run's config and the
endpoints its operator allowed (issues 48, 67 L2).

The rollout service sends ``engines.api_key`` to every engine it knows (``/generate``, health),
and the sync agent sends ``engines.admin_api_key``, pause and load calls and adapter tensors to
the same set. An engine added at run time (``POST /admin/engines``) must therefore be one the
operator meant: its host **and port** are those of one of ``engines.urls``, or it matches an
entry of ``engines.allowed_hosts``:

- ``host:port`` (``[v6]:port`` for an IPv6 address): that endpoint only;
- ``host`` (a name or an address, compared exactly as written): any port of that host;
- a network in CIDR form (``10.0.0.0/24``): any port of any address in it.

Before issue 67 a configured engine's host allowed every port of it, so a listener on another
port of an engine node (any local user) could be registered and collect the engine key. A URL
with a user name or password, a query or a fragment is never an engine's (:func:`url_shape_problem`).
:func:`engine_url_refusal` says why a URL may not be used, or None.

Not covered: DNS that answers differently later (a host name is compared as written).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from urllib.parse import SplitResult, urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


def _split(url: str) -> SplitResult | None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port out of range or not a number
    except ValueError:
        return None
    return parts


def _endpoint(parts: SplitResult) -> tuple[str, int | None]:
    host = (parts.hostname or "").lower()
    return host, parts.port or DEFAULT_PORTS.get(parts.scheme)


def url_shape_problem(url: str) -> str | None:
    """Why ``url`` is not an engine's base URL (``http(s)://host[:port][/path]``), or None: a
    user name or password, a query or a fragment would be sent somewhere or mean something
    the engine client never sends."""
    parts = _split(url)
    if parts is None or parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return f"engine URL {url!r} is not http(s)://host[:port]"
    if parts.username is not None or parts.password is not None:
        return f"engine URL {url!r} carries a user name or password: engines take their key as a bearer token (engines.api_key)"
    if parts.query or parts.fragment or url.rstrip().endswith(("?", "#")):
        return f"engine URL {url!r} has a query or fragment: give the engine's base URL only"
    return None


def _same_host(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


def allowed_entry_problem(entry: str) -> str | None:
    """Why an ``engines.allowed_hosts`` entry is not ``host``, ``host:port``, ``[v6]:port`` or a
    CIDR network, or None."""
    entry = entry.strip().lower()
    if "/" in entry:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError as exc:
            return f"engines.allowed_hosts entry {entry!r} is not a CIDR network: {exc}"
        return None
    if _bare_address(entry) is not None:
        return None
    parts = _split(f"//{entry}")
    if parts is None or not parts.hostname or parts.username or parts.password or parts.path:
        return f"engines.allowed_hosts entry {entry!r} is not host, host:port, [v6]:port or a CIDR network"
    return None


def _bare_address(entry: str) -> str | None:
    try:
        return str(ipaddress.ip_address(entry.strip("[]")))
    except ValueError:
        return None


def _entry_allows(entry: str, host: str, port: int | None) -> bool:
    entry = entry.strip().lower()
    if allowed_entry_problem(entry):
        return False
    if "/" in entry:
        try:
            return ipaddress.ip_address(host) in ipaddress.ip_network(entry, strict=False)
        except ValueError:
            return False
    bare = _bare_address(entry)
    if bare is not None:  # an address without a port (an IPv6 one's colons are no port)
        return _same_host(bare, host)
    parts = _split(f"//{entry}")
    return _same_host(parts.hostname, host) and (parts.port is None or parts.port == port)


def engine_url_refusal(url: str, configured: Sequence[str], allowed_hosts: Sequence[str]) -> str | None:
    """Why ``url`` may not be used as an engine (module docstring), or None."""
    problem = url_shape_problem(url)
    if problem:
        return problem
    host, port = _endpoint(_split(url))
    if (host, port) in {_endpoint(p) for p in (_split(u) for u in configured) if p is not None and p.hostname}:
        return None
    if any(_entry_allows(entry, host, port) for entry in allowed_hosts):
        return None
    return (f"engine URL {url} is not allowed: {host}:{port} is neither a configured engine's endpoint (engines.urls) "
            "nor allowed by engines.allowed_hosts (host:port, a host for any of its ports, or a CIDR network); the "
            "service sends the engine keys to every engine it knows, so an engine added at run time must be one the "
            "configuration allows")
