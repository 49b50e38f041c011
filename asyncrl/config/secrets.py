"""Reading secret config fields: the one place a ``SecretStr`` becomes plain text.

Config tokens and keys are ``SecretStr | None`` so they never print (``config show``, logs,
reprs). Code that must send one (an HTTP header, a NATS password) calls :func:`secret`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, SecretStr


def secret(value: SecretStr | None) -> str | None:
    """The plain text of an optional secret field; None when it is unset or empty."""
    return value.get_secret_value() or None if value is not None else None


def revealed_document(model: BaseModel) -> dict[str, Any]:
    """``model`` as plain data with every secret in clear: for the 0600 file a launcher writes
    for its child processes (``model_dump(mode="json")`` masks them)."""
    def plain(value: Any) -> Any:
        if isinstance(value, SecretStr):
            return value.get_secret_value()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value
    return plain(model.model_dump(mode="python"))
