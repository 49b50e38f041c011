"""Fixtures for the tools tests: sandboxes with tight limits that check for leftovers."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.tools.sandbox_helpers import IS_ROOT, TIGHT_LIMITS, sandbox_pids
from tools.python_sandbox import PythonSandbox


@pytest.fixture
def work_root() -> Iterator[Path]:
    """A world-traversable parent for the runs' directories (like /tmp in production)."""
    root = Path(tempfile.mkdtemp(prefix="asyncrl-test-sandbox-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def make_sandbox(work_root: Path) -> Iterator[Callable[..., PythonSandbox]]:
    """Build sandboxes with TIGHT_LIMITS (overridable); afterwards assert nothing survived.
    The tool fails closed without root (test_sandbox_isolation.py checks that refusal
    everywhere); running programs needs root, as in production."""
    if not IS_ROOT:
        pytest.skip("the python tool runs programs only as a per-run uid, which needs root")

    def build(**overrides: object) -> PythonSandbox:
        return PythonSandbox(**{**TIGHT_LIMITS, "work_root": str(work_root), **overrides})

    yield build
    survivors = sandbox_pids()
    for pid in survivors:  # never leave a runaway test program behind, then fail loudly
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    assert not survivors, f"sandbox processes outlived their run: {survivors}"
    assert list(work_root.iterdir()) == [], "a run's temporary directory was not deleted"


@pytest.fixture
def sandbox(make_sandbox: Callable[..., PythonSandbox]) -> PythonSandbox:
    return make_sandbox()
