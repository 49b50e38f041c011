"""Command-line flags derived from a pydantic model, so that a setting is defined once: as a field.

Each leaf field is one flag: ``max_batch_size`` is ``--max-batch-size``; a nested section's
fields take its name as a prefix (``timing.decode_ms`` is ``--timing-decode-ms``); a field may
name its flag instead (``Field(json_schema_extra={"flag": "--timing-mode"})``). Booleans get
``--x`` / ``--no-x`` (also ``bool | None``, SGLang's tri-state switches); a list field takes
one or more values (``--lora-target-modules q_proj v_proj``, SGLang's ``nargs``); every other
value is a string converted and checked by the model, so a bad value is refused the way the
model refuses it.

:func:`to_argv` writes the fields that differ from their defaults (``--flag value``, or
``--flag=value`` when the value starts with ``-``); :func:`add_flags` and :func:`parsed` read
them back. Not covered: dict fields, a None value for a field whose default is not None
(neither has a flag form; :func:`to_argv` refuses).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

FieldPath = tuple[str, ...]
_SEP = "::"  # argparse dest of a nested field: "timing::decode_ms"


def _submodel(info: FieldInfo) -> type[BaseModel] | None:
    ann = info.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def leaves(model: type[BaseModel], prefix: FieldPath = ()) -> Iterator[tuple[FieldPath, FieldInfo]]:
    """Every leaf field of ``model`` with its path, nested sections flattened, in field order."""
    for name, info in model.model_fields.items():
        sub = _submodel(info)
        if sub is not None:
            yield from leaves(sub, (*prefix, name))
        else:
            yield (*prefix, name), info


def flag_of(path: FieldPath, info: FieldInfo) -> str:
    """The flag of the field at ``path`` (module docstring)."""
    extra = info.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("flag"), str):
        return extra["flag"]
    return "--" + "-".join(path).replace("_", "-")


def _is_bool(info: FieldInfo) -> bool:
    return info.annotation is bool or set(get_args(info.annotation)) == {bool, type(None)}


def _is_list(info: FieldInfo) -> bool:
    ann = info.annotation
    return get_origin(ann) is list or any(get_origin(a) is list for a in get_args(ann))


def _metavar(info: FieldInfo) -> str:
    ann = info.annotation
    if get_origin(ann) is not Literal:  # X | None → X
        ann = next((a for a in get_args(ann) if a is not type(None)), ann)
    if get_origin(ann) is Literal:
        return "{" + ",".join(map(str, get_args(ann))) + "}"
    return {int: "N", float: "X"}.get(ann, "TEXT")


def _help(info: FieldInfo) -> str:
    return " ".join((info.description or "").split()).replace("``", "").replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], groups: Mapping[str, str] | None = None) -> None:
    """One flag per leaf field of ``model``; a flag not given is absent from the parsed
    namespace (the model's default applies). ``groups``: top-level section name → title of
    an argument group for its flags."""
    titled = {name: parser.add_argument_group(title) for name, title in (groups or {}).items()}
    for path, info in leaves(model):
        target = titled.get(path[0], parser) if len(path) > 1 else parser
        kwargs: dict[str, Any] = {"dest": _SEP.join(path), "default": argparse.SUPPRESS, "help": _help(info)}
        if _is_bool(info):
            target.add_argument(flag_of(path, info), action=argparse.BooleanOptionalAction, **kwargs)
        elif _is_list(info):
            target.add_argument(flag_of(path, info), metavar="TEXT", nargs="+", **kwargs)
        else:
            target.add_argument(flag_of(path, info), metavar=_metavar(info), **kwargs)


def parsed(namespace: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as the nested dict the model validates."""
    out: dict[str, Any] = {}
    for dest, value in vars(namespace).items():
        *parents, leaf = dest.split(_SEP)
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def to_argv(model: BaseModel, skip: Sequence[str] = ()) -> list[str]:
    """The flags of every leaf field of ``model`` that differs from its default (module
    docstring), except the top-level fields named in ``skip``."""
    argv: list[str] = []
    for path, info in leaves(type(model)):
        if path[0] in skip:
            continue
        value: Any = model
        for name in path:
            value = getattr(value, name)
        default = info.get_default(call_default_factory=True)
        if value == default:
            continue
        flag = flag_of(path, info)
        if _is_bool(info) and value is not None:
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            raise ValueError(f"{'.'.join(path)}: None has no command-line form (the default is {default!r})")
        elif _is_list(info):
            argv.extend([flag, *map(str, value)])
        else:
            text = str(value)  # str(float) round-trips exactly
            argv.extend([f"{flag}={text}"] if text.startswith("-") else [flag, text])
    return argv


def describe_errors(exc: ValidationError, model: type[BaseModel]) -> str:
    """One line per problem, naming the field and its flag: ``max_batch_size (--max-batch-size):
    Input should be greater than or equal to 1 (got '0')``."""
    flags = {path: flag_of(path, info) for path, info in leaves(model)}
    lines = []
    for err in exc.errors():
        path = tuple(str(p) for p in err["loc"])
        name = ".".join(path) or "settings"
        flag = flags.get(path)
        where = f"{name} ({flag})" if flag else name
        got = f" (got {err['input']!r})" if path and not isinstance(err.get("input"), dict) else ""
        lines.append(f"{where}: {err['msg']}{got}")
    return "\n".join(lines)
