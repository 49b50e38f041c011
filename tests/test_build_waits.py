"""A test that starts while the warm model's background build is unfinished gets the build's
time on top of its timeout; once the build is done, the plain limit holds again
(tests/helpers/build_waits.py, hooked in tests/conftest.py).

Each case runs pytest in a child process over a small test file, with pytest-timeout as the
suite has it and the same hook as tests/conftest.py, against a cache of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFTEST = '''
import pytest

@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item):
    from tests.helpers.build_waits import allow_for_unfinished_builds
    allow_for_unfinished_builds(item)
    yield

@pytest.fixture
def warm_model():
    return None
'''

TESTS = '''
import time
import pytest

@pytest.mark.timeout(1)
def test_needs_the_warm_model(warm_model):
    time.sleep(2.5)  # as if waiting on the build's lock

@pytest.mark.timeout(1, method="signal")
def test_needs_nothing_built():
    time.sleep(2.5)
'''


def run(tmp_path: Path, built: bool) -> str:
    project, cache = tmp_path / "project", tmp_path / "cache"
    project.mkdir()
    (project / "conftest.py").write_text(CONFTEST)
    (project / "test_waits.py").write_text(TESTS)
    env = {**os.environ, "ASYNCRL_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    if built:
        marker = subprocess.run([sys.executable, "-c", "from recipes.demo.warmup import cached_dir; "
                                 "from tests.helpers.warm_model import TEST_RECIPE; from asyncrl.models.cache import MARKER; "
                                 "print(cached_dir(TEST_RECIPE) / MARKER)"],
                                env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        assert marker.startswith(str(cache))
        Path(marker).parent.mkdir(parents=True)
        Path(marker).write_text("done\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-o", "timeout=300",
                          str(project)], env=env, cwd=project, capture_output=True, text=True, timeout=120)
    return out.stdout


def test_a_test_waiting_for_the_unfinished_warm_model_is_given_the_builds_time(tmp_path):
    out = run(tmp_path, built=False)
    assert "PASSED test_waits.py::test_needs_the_warm_model" in out, out
    # a test that needs no build keeps its limit, and its marker's method with it
    assert "FAILED test_waits.py::test_needs_nothing_built" in out and "Timeout" in out, out


def test_once_the_warm_model_is_built_the_plain_limit_holds(tmp_path):
    out = run(tmp_path, built=True)
    assert "FAILED test_waits.py::test_needs_the_warm_model" in out and "Timeout" in out, out
    assert "FAILED test_waits.py::test_needs_nothing_built" in out, out
