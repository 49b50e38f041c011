"""Reading secret config fields: the one place a ``SecretStr`` becomes plain text.

Config tokens and keys are ``SecretStr | None`` so they never print (``config show``, logs,
reprs). Code that must send one (an HTTP header, a NATS password) calls :func:`secret`.
"""

from __future__ import annotations

from pydantic import SecretStr


def secret(value: SecretStr | None) -> str | None:
    """The plain text of an optional secret field; None when it is unset or empty."""
    return value.get_secret_value() or None if value is not None else None
