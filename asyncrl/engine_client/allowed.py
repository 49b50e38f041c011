"""Which engine URLs may receive the engine keys: the engines of the run's config and the hosts
its operator allowed (issue 48).

The rollout service sends ``engines.api_key`` to every engine it knows (``/generate``, health),
and the sync agent sends ``engines.admin_api_key``, pause and load calls and adapter tensors to
the same set. An engine added at run time (``POST /admin/engines``) must therefore be one the
operator meant: its host is the host of one of ``engines.urls`` or matches an entry of
``engines.allowed_hosts`` (a host name or address, compared exactly, or a network in CIDR form,
``10.0.0.0/24``). :func:`engine_url_refusal` says why a URL is not, or None.

Not covered: DNS that answers differently later (a host name is compared as written).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from urllib.parse import urlsplit


def _host(url: str) -> str | None:
    try:
        return urlsplit(url).hostname
    except ValueError:
        return None


def engine_url_refusal(url: str, configured: Sequence[str], allowed_hosts: Sequence[str]) -> str | None:
    """Why ``url`` may not be used as an engine (module docstring), or None."""
    host = _host(url)
    if not host:
        return f"engine URL {url!r} names no host"
    if host in {h for h in (_host(u) for u in configured) if h}:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in allowed_hosts:
        entry = entry.strip().lower()
        if "/" in entry:
            try:
                if address is not None and address in ipaddress.ip_network(entry, strict=False):
                    return None
            except ValueError:
                continue
        elif entry.strip("[]") == host.lower():
            return None
    return (f"engine URL {url} is not allowed: its host {host!r} is neither a configured engine's (engines.urls) nor in "
            "engines.allowed_hosts (host names, addresses or CIDR networks); the service sends the engine keys to every "
            "engine it knows, so an engine added at run time must be one the configuration allows")
