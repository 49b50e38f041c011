"""The one logging set-up (asyncrl.logs): JSON lines with the fields, text otherwise, idempotent;
and a real entry point (a trainer rank) that logs JSON lines when ``run.log_json`` is true."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest

from asyncrl.logs import configure_logging

PROCESS_TIMEOUT_S = 120  # a trainer rank imports torch and forms a one-rank group: ~5 s


@pytest.fixture
def root_logger():
    """Restore the root logger (level, handlers) after the test."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield root
    for h in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)


def test_json_lines_carry_time_level_logger_message_and_exception(root_logger):
    out = io.StringIO()
    configure_logging("info", json_lines=True, tag="trainer[1]", stream=out)
    log = logging.getLogger("asyncrl.test")
    log.debug("hidden")
    log.info("hello %s", "world")
    try:
        1 / 0  # noqa: B018
    except ZeroDivisionError:
        log.exception("it failed: %d", 7)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(d["level"], d["logger"], d["message"]) for d in lines] == [
        ("INFO", "asyncrl.test", "hello world"), ("ERROR", "asyncrl.test", "it failed: 7")]
    assert all(d["process"] == "trainer[1]" and d["time"].endswith("+00:00") for d in lines)
    assert "exception" not in lines[0] and "ZeroDivisionError" in lines[1]["exception"]


def test_text_mode_and_calling_again_replaces_the_handler(root_logger):
    first, second = io.StringIO(), io.StringIO()
    configure_logging("WARNING", stream=first)
    configure_logging("DEBUG", stream=second)
    ours = [h for h in root_logger.handlers if getattr(h, "_asyncrl_handler", False)]
    assert len(ours) == 1 and root_logger.level == logging.DEBUG
    logging.getLogger("asyncrl.test").debug("plain %d", 1)
    assert first.getvalue() == "" and second.getvalue().rstrip().endswith(" DEBUG asyncrl.test: plain 1")


def test_a_trainer_rank_logs_json_lines(tmp_path):
    """An entry point with ``run.log_json=true``: every stderr line is one JSON object, the
    failure among them with its traceback."""
    out = subprocess.run([sys.executable, "-m", "trainer_daemon", f"model.path={tmp_path / 'no-model'}",
                          "run.log_json=true", f"run.dir={tmp_path / 'run'}", "run.id=logs"],
                         capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    assert out.returncode == 1, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stderr.splitlines() if line.strip()]
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    failed = [r for r in records if r["level"] == "ERROR"]
    assert failed and failed[-1]["process"] == "trainer[0]" and "no config.json" in failed[-1]["exception"]
