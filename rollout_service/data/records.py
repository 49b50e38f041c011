"""The typed prompt record and the validation of one raw row in verl's layout.

A row (one JSONL line or one Parquet row) looks like::

    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
     "data_source": "asyncrl/arith",
     "reward_model": {"style": "rule", "ground_truth": "5"},
     "extra_info": {"index": 0, "split": "train"},
     "ability": "math"}

Contract of :func:`record_from_row`: it either returns a :class:`PromptRecord` or raises
:class:`RowValidationError` whose ``kind`` is one of :data:`ERROR_KINDS` and whose message
names the offending field. It never raises anything else for any JSON-like input and never
evaluates content. Messages keep any extra keys (``tool_calls``, ``name``...) as given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ALLOWED_ROLES = frozenset({"system", "user", "assistant", "tool"})

ERROR_KINDS = (
    "bad_json",  # not decodable (JSONL) or not an object
    "missing_field",  # a required key is absent
    "wrong_type",  # a key has the wrong type
    "empty_prompt",  # ``prompt`` is an empty list
    "bad_message",  # a message lacks role/content or has the wrong types
    "bad_role",  # a role outside ALLOWED_ROLES
)


class RowValidationError(ValueError):
    """A row is malformed; ``kind`` is one of :data:`ERROR_KINDS`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class RowError:
    """A malformed row, as reported to the ``on_error`` callback.

    ``line`` is the 1-based line number for JSONL and the 0-based row index for Parquet
    (``unit`` says which).
    """

    file: str
    line: int
    unit: str  # "line" (JSONL) or "row" (Parquet)
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.unit} {self.line}: {self.kind}: {self.message}"


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """One validated prompt. Treat it as read-only (``extra_info`` and the message dicts are
    plain containers shared with the loader; :meth:`chat` returns copies).

    ``prompt_id`` is stable across runs: ``str(extra_info["index"])`` when the row has an
    index, else ``"{file_stem}:{line_or_row}"``. It is not guaranteed unique across files
    (the loader reports duplicates).
    """

    prompt_id: str
    messages: tuple[Mapping[str, Any], ...]
    data_source: str
    ground_truth: Any
    extra_info: Mapping[str, Any] = field(default_factory=dict)
    source_file: str = ""
    source_line: int = 0
    ability: str | None = None

    def chat(self) -> list[dict[str, Any]]:
        """The messages as fresh dicts, ready for a chat template."""
        return [dict(m) for m in self.messages]


def _require(row: Mapping[str, Any], key: str) -> Any:
    if key not in row or row[key] is None:
        raise RowValidationError("missing_field", f"missing required field {key!r}")
    return row[key]


def _validate_messages(prompt: Any) -> tuple[dict[str, Any], ...]:
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (list, tuple)):
        raise RowValidationError("wrong_type", f"'prompt' must be a list of messages, got {type(prompt).__name__}")
    if not prompt:
        raise RowValidationError("empty_prompt", "'prompt' is an empty list")
    messages = []
    for i, msg in enumerate(prompt):
        if not isinstance(msg, Mapping):
            raise RowValidationError("bad_message", f"prompt[{i}] must be an object, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str):
            raise RowValidationError("bad_message", f"prompt[{i}].role must be a string, got {type(role).__name__}")
        if role not in ALLOWED_ROLES:
            raise RowValidationError("bad_role", f"prompt[{i}].role {role!r} is not one of {sorted(ALLOWED_ROLES)}")
        if not isinstance(content, str):
            raise RowValidationError(
                "bad_message", f"prompt[{i}].content must be a string, got {type(content).__name__}"
            )
        messages.append({k: v for k, v in msg.items()})
    return tuple(messages)


def record_from_row(
    row: Any, *, file_stem: str, source_file: str, line: int, require_ground_truth: bool = True
) -> PromptRecord:
    """Validate one raw row and build its record (see the module doc for the contract).

    ``require_ground_truth``: when True a missing ``reward_model.ground_truth`` is a
    ``missing_field`` error; when False it becomes ``None``.
    """
    if not isinstance(row, Mapping):
        raise RowValidationError("bad_json", f"row must be a JSON object, got {type(row).__name__}")
    messages = _validate_messages(_require(row, "prompt"))
    data_source = _require(row, "data_source")
    if not isinstance(data_source, str) or not data_source:
        raise RowValidationError("wrong_type", "'data_source' must be a non-empty string")
    reward_model = row.get("reward_model")
    if reward_model is None:
        reward_model = {}
    if not isinstance(reward_model, Mapping):
        raise RowValidationError("wrong_type", f"'reward_model' must be an object, got {type(reward_model).__name__}")
    ground_truth = reward_model.get("ground_truth")
    if ground_truth is None and require_ground_truth:
        raise RowValidationError("missing_field", "missing required field 'reward_model.ground_truth'")
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, Mapping):
        raise RowValidationError("wrong_type", f"'extra_info' must be an object, got {type(extra_info).__name__}")
    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise RowValidationError("wrong_type", f"'ability' must be a string, got {type(ability).__name__}")
    index = extra_info.get("index")
    if index is not None and (isinstance(index, bool) or not isinstance(index, (int, str))):
        raise RowValidationError("wrong_type", f"'extra_info.index' must be an int or string, got {type(index).__name__}")
    prompt_id = str(index) if index is not None else f"{file_stem}:{line}"
    return PromptRecord(
        prompt_id=prompt_id,
        messages=messages,
        data_source=data_source,
        ground_truth=ground_truth,
        extra_info=dict(extra_info),
        source_file=source_file,
        source_line=line,
        ability=ability,
    )
