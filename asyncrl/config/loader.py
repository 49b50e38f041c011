"""Load a :class:`RunConfig` from a file, environment variables and ``key=value`` arguments.

Precedence, lowest to highest: field defaults < the file (TOML, YAML or JSON) <
``ASYNCRL_SECTION__KEY`` environment variables < command-line ``section.key=value``.

Values from the environment and the command line are strings; pydantic converts them to
the field's type (``"4"`` → 4, ``"true"`` → True). A value starting with ``[`` or ``{`` is
parsed as YAML flow (so JSON works), ``null`` / ``none`` mean None. Environment variables
are config overrides only when their name has a double underscore after ``ASYNCRL_``
(``ASYNCRL_ROLLOUT__SAMPLING__TEMPERATURE=0.7``); single-underscore ``ASYNCRL_*`` variables
(``ASYNCRL_CACHE_DIR``) are left to the programs that read them. ``ASYNCRL_SECTION__KEY_FILE=path``
gives ``section.key`` the content of the file (Docker/Kubernetes secrets).

Errors raise :class:`ConfigError` naming the field, where its value came from, the value,
and the allowed range.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.config.run_config import RunConfig

ENV_PREFIX = "ASYNCRL_"
ENV_NESTING = "__"
FILE_SUFFIX = "_file"  # ASYNCRL_SECURITY__ADMIN_TOKEN_FILE: the field's value is that file's content


class ConfigError(ValueError):
    """A config value is invalid or a config file cannot be read; the message says which."""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML, YAML or JSON config file into nested dicts."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist{_nearby_config(p)}")
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {p}: unknown format {p.suffix!r} (use .toml, .yaml, .yml or .json)")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"config file {p}: cannot parse: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: the top level must be a mapping of sections")
    return data


def _nearby_config(path: Path) -> str:
    """``; did you mean examples/x.toml?`` for a misspelt config file, from its directory; for
    ``rollout.n`` (an override without its value, taken for a file name) the override's form."""
    if path.suffix not in (".toml", ".yaml", ".yml", ".json") and str(path).split(".")[0] in RunConfig.model_fields:
        return f"; an override needs a value: {path}=<value>"
    folder = path.parent if path.parent.is_dir() else None
    if folder is None:
        return f" (its directory {path.parent} does not exist either)"
    names = [q.name for q in folder.iterdir() if q.suffix in (".toml", ".yaml", ".yml", ".json") and q.is_file()]
    close = difflib.get_close_matches(path.name, names, n=2, cutoff=0.8)
    return f"; did you mean {' or '.join(str(path.parent / c) for c in close)}?" if close else ""


def parse_value(raw: str) -> Any:
    """Turn a command-line or environment string into a config value (see module doc)."""
    text = raw.strip()
    if text.lower() in ("null", "none", "~"):
        return None
    if text[:1] in ("[", "{"):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"cannot parse {raw!r} as a list or mapping: {exc}") from exc
    return raw


def _set_dotted(target: dict[str, Any], dotted: str, value: Any, sources: dict[str, str], source: str) -> None:
    parts = [p for p in dotted.split(".")]
    if not all(parts):
        raise ConfigError(f"{source}: {dotted!r} is not a dotted key such as rollout.n")
    node = target
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value
    sources[dotted] = source


def overrides_from_args(args: Sequence[str], sources: dict[str, str]) -> dict[str, Any]:
    """``["rollout.n=8", ...]`` → nested dict."""
    out: dict[str, Any] = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep:
            raise ConfigError(f"argument {arg!r} is not of the form section.key=value")
        _set_dotted(out, key.strip(), parse_value(raw), sources, f"argument {arg!r}")
    return out


def overrides_from_env(environ: Mapping[str, str], sources: dict[str, str]) -> dict[str, Any]:
    """``ASYNCRL_ROLLOUT__N=8`` → ``{"rollout": {"n": "8"}}``. A name ending in ``_FILE``
    (``ASYNCRL_SECURITY__ADMIN_TOKEN_FILE=/run/secrets/admin_token``) gives the content of
    that file (one trailing newline removed) to the field without the suffix, taken as it is:
    secrets then never sit in the environment, where ``ps e``, ``docker inspect`` and
    ``/proc/<pid>/environ`` show them."""
    out: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):]
        if ENV_NESTING not in rest:
            continue
        dotted = ".".join(part.lower() for part in rest.split(ENV_NESTING))
        if dotted.endswith(FILE_SUFFIX):
            where = f"the file {raw} (environment variable {name})"
            try:
                value: Any = Path(raw).read_text().removesuffix("\n")
            except OSError as exc:
                raise ConfigError(f"invalid config: {name}: cannot read {raw}: {exc.strerror or exc}") from None
            _set_dotted(out, dotted.removesuffix(FILE_SUFFIX), value, sources, where)
            continue
        _set_dotted(out, dotted, parse_value(raw), sources, f"environment variable {name}")
    return out


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _field_bounds(loc: tuple[Any, ...]) -> str:
    """Human-readable bounds of the field at ``loc`` (``"[1, 1024]"``), or ''."""
    model: type[BaseModel] | None = RunConfig
    info = None
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return ""
        info = model.model_fields[part]
        ann = info.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    if info is None:
        return ""
    lo = hi = None
    lo_open = hi_open = False
    for meta in info.metadata:
        if isinstance(meta, annotated_types.Ge):
            lo = meta.ge
        elif isinstance(meta, annotated_types.Gt):
            lo, lo_open = meta.gt, True
        elif isinstance(meta, annotated_types.Le):
            hi = meta.le
        elif isinstance(meta, annotated_types.Lt):
            hi, hi_open = meta.lt, True
    if lo is None and hi is None:
        return ""
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"


def _origin(dotted: str, sources: Mapping[str, str]) -> str | None:
    """Where the value at ``dotted`` came from: the source of the most specific key that covers
    it (an argument ``rollout.n=0`` over the file that set the ``rollout`` section)."""
    covering = [key for key in sources if dotted == key or dotted.startswith(key + ".")]
    return sources[max(covering, key=len)] if covering else None


def _unknown_key(loc: tuple[Any, ...]) -> str:
    """``rollout.nn: unknown key`` with the section's nearest field names, for a typo."""
    model: type[BaseModel] | None = RunConfig
    for part in loc[:-1]:
        ann = model.model_fields[part].annotation if model is not None and part in model.model_fields else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    where = ".".join(str(p) for p in loc[:-1]) or "the top level"
    if model is None:
        return f"unknown key in {where}"
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else \
        f"; its keys: {', '.join(model.model_fields)}"
    return f"unknown key (Extra inputs are not permitted) in {where}{hint}"


def _format_errors(exc: ValidationError, sources: Mapping[str, str]) -> str:
    """Every problem on a line of its own; one problem is one line (``invalid config: ...``)."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        dotted = ".".join(str(p) for p in loc)
        origin = _origin(dotted, sources)
        msg = _unknown_key(loc) if err.get("type") == "extra_forbidden" else err["msg"]
        line = f"{dotted}: {msg}"
        if err.get("type") != "missing":
            line += f" (got {err.get('input')!r}"
            line += f" from {origin})" if origin else ")"
        bounds = _field_bounds(loc)
        if bounds:
            line += f"; allowed range {bounds}"
        lines.append(line)
    if len(lines) == 1:
        return f"invalid config: {lines[0]}"
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Resolve the run config (see the module docstring for precedence and syntax)."""
    sources: dict[str, str] = {}
    data: dict[str, Any] = {}
    if path is not None:
        data = read_config_file(path)
        for section in data:
            sources[section] = f"file {path}"
    env = os.environ if environ is None else environ
    data = _deep_merge(data, overrides_from_env(env, sources))
    data = _deep_merge(data, overrides_from_args(overrides, sources))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, sources)) from None
