"""Which bind addresses keep a server on this machine: the rule behind "a token for any
non-loopback bind" and "``--insecure-dev`` binds loopback only" (docs/security.md).

``is_loopback_bind(host)``: ``localhost``, any ``127.0.0.0/8`` address or ``::1``. A wildcard
(``0.0.0.0``, ``::``, ``""``), a host name or any other address reaches other machines (a
wildcard inside a container reaches the container network and every published port).
"""

from __future__ import annotations

import ipaddress


def is_loopback_bind(host: str | None) -> bool:
    if host is None:
        return False
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_refusal(host: str, insecure_dev: bool, token_ok: bool, token_name: str) -> str | None:
    """Why a server must not start on ``host``, or None: ``--insecure-dev`` only on loopback;
    off loopback, ``token_name`` must be set to a real secret (``token_ok``)."""
    if is_loopback_bind(host):
        return None
    if insecure_dev:
        return (f"--insecure-dev (security.insecure_dev) binds loopback only, but the bind address is {host!r}; "
                "bind 127.0.0.1 or drop --insecure-dev and set real tokens")
    if not token_ok:
        return (f"{token_name} must be set (12+ characters) when binding a non-loopback address ({host!r}): "
                "without it anyone who reaches the port may use it")
    return None
