"""tests/loop: the whole loop as real processes.

``test_finite_run_faults.py``'s matrix (six faults near a finite run's end, ~4 minutes) is the
``./dev test-endings`` tier (``ASYNCRL_ENDINGS_TESTS=1``); ``./dev test`` runs only its cases
marked ``endings_slice`` and lists the others as deselected (never skipped).
``test_agents_sdk_learns.py`` (an Agents SDK agent trained through sessions until its reward
rises, ~5 minutes) is the ``./dev test-agents`` tier (``ASYNCRL_AGENTS_TESTS=1``) and
``test_moe_learns.py`` (a mixture-of-experts policy learning with routing replay, ~10 minutes)
the ``./dev test-moe`` tier (``ASYNCRL_MOE_TESTS=1``), deselected from ``./dev test`` likewise."""

from __future__ import annotations

import os

import pytest

ENDINGS_MODULE = "tests/loop/test_finite_run_faults.py"
TIER_MODULES = {"tests/loop/test_agents_sdk_learns.py": "ASYNCRL_AGENTS_TESTS", "tests/loop/test_moe_learns.py": "ASYNCRL_MOE_TESTS"}
"""Modules that run only in their own tier: the environment variable that turns each on."""
SLICE = "endings_slice"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{SLICE}: a case of the finite-run fault matrix that ./dev test runs too")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    endings = os.environ.get("ASYNCRL_ENDINGS_TESTS") == "1"
    off = tuple(module for module, env in TIER_MODULES.items() if os.environ.get(env) != "1")
    kept, deselected = [], []
    for item in items:
        outside = (not endings and item.nodeid.startswith(ENDINGS_MODULE) and item.get_closest_marker(SLICE) is None) \
            or item.nodeid.startswith(off)
        (deselected if outside else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
