"""The tool interface: what every agent tool declares, returns and promises.

A tool is an object with a ``name``, a ``description`` and a JSON-schema ``parameters``
object; from these it builds its OpenAI function schema
(``{"type": "function", "function": {"name", "description", "parameters"}}``) for the
chat template. It is called with ``await tool.call(arguments, timeout_s=...)`` and
answers a :class:`ToolResult`.

Contract for implementations:
- ``call`` finishes within ``timeout_s`` (plus a moment for cleanup) and cleans up what
  it started (processes, files) even when it is cancelled.
- ``call`` may be awaited many times at once from one event loop: no global state, no
  blocking of the loop for more than a few milliseconds.
- Failures the model caused (bad input, its program crashed) come back as a result with
  ``is_error=True`` and a short message for the model, not as exceptions. Exceptions are
  tolerated (:class:`tools.registry.ToolRegistry` turns them into error results) but are
  meant for bugs.

:func:`validate_arguments` checks arguments against the declared schema. It covers the
subset of JSON schema that tool parameters use (``type``, ``required``, ``properties``,
``enum``, ``additionalProperties: false``, ``maxLength``, ``minimum``, ``maximum``), one
level deep. Not covered: ``$ref``, ``anyOf``/``oneOf``, ``pattern``, formats, and the
contents of nested objects and arrays (tools check those themselves).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

# JSON schema type name -> Python types. bool is an int subclass, so it is excluded by hand.
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a tool call produced.

    ``content`` is the text shown to the model (as the tool message); ``is_error`` marks a
    failed call (the text then says why, briefly); ``metadata`` is for logs and metrics
    (exit codes, timings, isolation in effect) and is never shown to the model.
    """

    content: str
    is_error: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def ok(cls, content: str, **metadata: Any) -> ToolResult:
        return cls(content=content, is_error=False, metadata=metadata)

    @classmethod
    def error(cls, message: str, **metadata: Any) -> ToolResult:
        return cls(content=message, is_error=True, metadata=metadata)


class Tool(abc.ABC):
    """Base class of agent tools. Subclasses set the three class attributes and ``call``."""

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: dict[str, Any]  # a JSON schema with "type": "object"

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling schema of this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def validate(self, arguments: Any) -> str | None:
        """None when ``arguments`` fit :attr:`parameters`, else a message for the model."""
        return validate_arguments(self.parameters, arguments)

    @abc.abstractmethod
    async def call(self, arguments: dict[str, Any], *, timeout_s: float) -> ToolResult:
        """Run the tool on validated ``arguments``, finishing within ``timeout_s`` seconds."""


def _type_matches(value: Any, type_spec: str | list[str]) -> bool:
    names = [type_spec] if isinstance(type_spec, str) else list(type_spec)
    for type_name in names:
        python_types = _JSON_TYPES.get(type_name)
        if python_types is None:
            continue  # unknown type names are not ours to police
        if isinstance(value, bool) and type_name in ("integer", "number"):
            continue
        if isinstance(value, python_types):
            return True
        if type_name == "integer" and isinstance(value, float) and value.is_integer():
            return True  # JSON has one number type: 3.0 is an acceptable integer
    return False


def _type_label(type_spec: str | list[str]) -> str:
    return type_spec if isinstance(type_spec, str) else " or ".join(type_spec)


def validate_arguments(parameters: Mapping[str, Any], arguments: Any) -> str | None:
    """Check ``arguments`` against a tool's parameter schema (see the module docstring).

    Returns None when they fit, else one short message naming the first problem found.
    Never raises for any ``arguments`` value.
    """
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    properties: Mapping[str, Any] = parameters.get("properties", {})
    for key in parameters.get("required", []):
        if key not in arguments:
            return f"missing required argument '{key}'"
    if parameters.get("additionalProperties") is False:
        unknown = sorted(str(k) for k in arguments if k not in properties)
        if unknown:
            return f"unknown argument(s): {', '.join(unknown)}"
    for key, value in arguments.items():
        spec = properties.get(key)
        if not isinstance(spec, Mapping):
            continue
        if "type" in spec and not _type_matches(value, spec["type"]):
            return (
                f"argument '{key}' must be of type {_type_label(spec['type'])}, "
                f"got {type(value).__name__}"
            )
        if "enum" in spec and value not in spec["enum"]:
            return f"argument '{key}' must be one of {spec['enum']!r}"
        if isinstance(value, str) and "maxLength" in spec and len(value) > spec["maxLength"]:
            return f"argument '{key}' is too long ({len(value)} > {spec['maxLength']} characters)"
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if is_number and "minimum" in spec and value < spec["minimum"]:
            return f"argument '{key}' must be >= {spec['minimum']}"
        if is_number and "maximum" in spec and value > spec["maximum"]:
            return f"argument '{key}' must be <= {spec['maximum']}"
    return None
