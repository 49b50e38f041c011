"""Logging set-up of every asyncrl process: one function, text or JSON lines.

Every entry point (rollout service, sync agent, trainer ranks, local_engine, ``asyncrl up``)
calls :func:`configure_logging` once its settings are known, with ``run.log_level`` and
``run.log_json`` (local_engine: ``--log-level`` / ``--log-json``, which ``asyncrl up`` sets from
those). It installs one handler on the root logger, writing to stderr:

- text: ``2025-01-01 12:00:00,123 INFO [tag ]logger.name: message`` (and the traceback);
- JSON lines: one object per record, ``{"time": ISO-8601 UTC with ms, "level", "logger",
  "message"}`` plus ``"process"`` (the tag, when given) and ``"exception"`` (the formatted
  traceback, when the record has one). Values that JSON cannot hold are written with ``str``.

Python warnings are routed through it (``logging.captureWarnings``). Calling it again
replaces the handler it installed (idempotent); handlers installed by others are left alone. uvicorn's loggers reach this handler when uvicorn is run with
``log_config=None`` (the entry points do). Not covered: lines a process prints itself, or
that libraries write to stderr directly (tracebacks of crashes before the set-up, torchrun's
agent).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s {tag}%(name)s: %(message)s"
_MARK = "_asyncrl_handler"  # attribute that identifies the handler this module installed


class JsonLines(logging.Formatter):
    """One JSON object per record (module docstring)."""

    def __init__(self, tag: str | None = None) -> None:
        super().__init__()
        self.tag = tag

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.tag:
            doc["process"] = self.tag
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exception"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def configure_logging(level: str, *, json_lines: bool = False, tag: str | None = None,
                      stream: TextIO | None = None) -> logging.Handler:
    """Set the root logger's level (``"INFO"`` or ``"info"``) and its one asyncrl handler on
    ``stream`` (default stderr); ``tag`` names the process (``trainer[0]``). Returns the handler."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    setattr(handler, _MARK, True)
    if json_lines:
        handler.setFormatter(JsonLines(tag))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT.format(tag=f"{tag} " if tag else "")))
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # Python warnings become records (logger py.warnings), JSON too
    return handler
