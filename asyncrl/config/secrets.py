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
    """``model`` as JSON-able data with every secret in clear: for the 0600 file a launcher writes
    for its child processes (``model_dump(mode="json")`` alone masks them as ``**********``, a value
    a child would then send as its key). Every path that writes a configuration for services uses
    this (``asyncrl up``, ``asyncrl slurm``); tests/foundation/test_config.py walks every secret field."""
    def overlay(js: Any, py: Any) -> Any:
        if isinstance(py, SecretStr):
            return py.get_secret_value()
        if isinstance(py, dict) and isinstance(js, dict):
            return {k: overlay(js[k], py[k]) for k in js}
        if isinstance(py, (list, tuple)) and isinstance(js, list):
            return [overlay(j, p) for j, p in zip(js, py, strict=True)]
        return js
    return overlay(model.model_dump(mode="json"), model.model_dump(mode="python"))


def secret_values(model: BaseModel) -> list[str]:
    """Every secret field's plain text in ``model`` (non-empty ones), longest first."""
    found: list[str] = []

    def walk(py: Any) -> None:
        if isinstance(py, SecretStr):
            if py.get_secret_value():
                found.append(py.get_secret_value())
        elif isinstance(py, dict):
            for v in py.values():
                walk(v)
        elif isinstance(py, (list, tuple)):
            for v in py:
                walk(v)
    walk(model.model_dump(mode="python"))
    return sorted(set(found), key=len, reverse=True)


def redact(text: str, secrets: list[str], mask: str = "[redacted]") -> str:
    """``text`` with every occurrence of each of ``secrets`` replaced by ``mask``: for a log tail
    asyncrl copies somewhere others may read (SGLang logs its server args, keys included)."""
    for value in secrets:
        if value:
            text = text.replace(value, mask)
    return text
