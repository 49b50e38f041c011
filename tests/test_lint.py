"""The whole tree passes ruff with the project's rules (pyproject.toml), including the
security rules S307 (eval), S102 (exec) and S301 (pickle) on code that touches model output
and the network."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_ruff_is_clean():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
