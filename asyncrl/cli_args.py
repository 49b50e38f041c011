"""Command-line plumbing shared by every ``asyncrl`` subcommand that takes a run config:
``[CONFIG_FILE] [section.key=value ...]`` parsed into a :class:`RunConfig`, with invalid
values reported (field, source, allowed range) and exit status 2 instead of a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from asyncrl.config import ConfigError, RunConfig, load_config


def split_config_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """``[FILE] [k=v ...]`` → (file or None, overrides)."""
    items = list(args)
    path = None
    if items and "=" not in items[0]:
        path = items.pop(0)
    return path, items


def config_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the positional ``[CONFIG_FILE] [section.key=value ...]``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", help="[CONFIG_FILE] [section.key=value ...]")
    return parser


def resolve_config(args: Sequence[str], extra: Sequence[str] = ()) -> RunConfig | None:
    """The run config, or None after printing why it is invalid (callers exit with 2)."""
    path, overrides = split_config_args(args)
    try:
        return load_config(path, [*overrides, *extra])
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return None
