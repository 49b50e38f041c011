"""The environment that loads asyncrl's SGLang hook (``sitecustomize.py`` here) into every
Python process of an SGLang server: a bounded weight-group timeout (issue 66 N7)."""

from __future__ import annotations

import os
from pathlib import Path

HOOK_DIR = Path(__file__).resolve().parent
TIMEOUT_ENV = "ASYNCRL_WEIGHT_GROUP_TIMEOUT_S"


def hook_env(timeout_s: float, python_path: str | None = None) -> dict[str, str]:
    """``PYTHONPATH`` (this directory first, then ``python_path``: by default the caller's
    ``PYTHONPATH``) and the timeout, for an SGLang server's environment."""
    rest = os.environ.get("PYTHONPATH", "") if python_path is None else python_path
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(HOOK_DIR), rest) if p), TIMEOUT_ENV: f"{timeout_s:g}"}
