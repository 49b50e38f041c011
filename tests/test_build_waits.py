"""A test that starts while the warm model's background build is unfinished gets the build's
time on top of its timeout; once the build is done, or where timeouts are off, nothing changes
(tests/helpers/build_waits.py, hooked in tests/conftest.py).

Each case runs pytest in a child process over a small test file, with pytest-timeout as the
suite has it and the same hook as tests/conftest.py, against a cache of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.build_waits import WARM_MODEL_BOUND_S

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

def limit(request):
    marker = request.node.get_closest_marker("timeout")
    print("LIMIT", request.node.name, marker.args if marker else None, marker.kwargs if marker else None)

@pytest.mark.timeout(1, method="signal")
def test_needs_the_warm_model(warm_model, request):
    limit(request)
    time.sleep(2.5)  # as if waiting on the build's lock

def test_needs_it_without_a_marker(warm_model, request):
    limit(request)

@pytest.mark.timeout(1, method="signal")
def test_needs_nothing_built():
    time.sleep(2.5)
'''


def run(tmp_path: Path, built: bool, *args: str) -> str:
    project, cache = tmp_path / "project", tmp_path / "cache"
    project.mkdir()
    (project / "conftest.py").write_text(CONFTEST)
    (project / "test_waits.py").write_text(TESTS)
    env = {**os.environ, "ASYNCRL_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_TIMEOUT", None)
    if built:
        marker = subprocess.run([sys.executable, "-c", "from recipes.demo.warmup import cached_dir; "
                                 "from tests.helpers.warm_model import TEST_RECIPE; from asyncrl.models.cache import MARKER; "
                                 "print(cached_dir(TEST_RECIPE) / MARKER)"],
                                env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        assert marker.startswith(str(cache))
        Path(marker).parent.mkdir(parents=True)
        Path(marker).write_text("done\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-s", *args, str(project)],
                         env=env, cwd=project, capture_output=True, text=True, timeout=120)
    return out.stdout


def test_a_test_waiting_for_the_unfinished_warm_model_is_given_the_builds_time(tmp_path):
    out = run(tmp_path, False, "-o", "timeout=300")
    assert "PASSED test_waits.py::test_needs_the_warm_model" in out, out
    assert f"LIMIT test_needs_the_warm_model ({1 + WARM_MODEL_BOUND_S},) {{'method': 'signal'}}" in out, "the marker's method is kept"
    assert f"LIMIT test_needs_it_without_a_marker ({300 + WARM_MODEL_BOUND_S},) {{}}" in out, "the ini's limit is the base"
    # a test that needs no build keeps its limit
    assert "test_needs_nothing_built - Failed: Timeout" in out, out


def test_the_command_lines_limit_is_the_base_and_zero_leaves_timeouts_off(tmp_path):
    out = run(tmp_path, False, "-o", "timeout=300", "--timeout=20")
    assert f"LIMIT test_needs_it_without_a_marker ({20 + WARM_MODEL_BOUND_S},) {{}}" in out, out
    (tmp_path / "off").mkdir()
    off = run(tmp_path / "off", False, "-o", "timeout=300", "--timeout=0")
    assert "LIMIT test_needs_it_without_a_marker None None" in off, off


def test_once_the_warm_model_is_built_the_plain_limit_holds(tmp_path):
    out = run(tmp_path, True, "-o", "timeout=300")
    assert "test_needs_the_warm_model - Failed: Timeout" in out, out
    assert "LIMIT test_needs_it_without_a_marker None None" in out, out
    assert "test_needs_nothing_built - Failed: Timeout" in out, out
