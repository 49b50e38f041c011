"""The real-SGLang tier: the product against SGLang's own server (its scheduler, tokenizer
manager and HTTP server), on this CPU (tests/sglang_cpu: the venv per release, the stand-ins).

``./dev test-sglang`` (``ASYNCRL_SGLANG_TESTS=1``) runs every test here. ``./dev test`` runs
only the CI slice, the tests marked ``sglang_slice`` and those in :data:`SLICE_NODEIDS` (the
installer, the differential check, a 6-step loop, the abort sync, an engine killed mid-sync: the
loop, the sync transaction and a fault at small scale, on 0.5.23); the others are deselected
there (listed as such, never skipped). A test that cannot get its SGLang venv or server fails
with the reason, in both.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.helpers.processes import Engine
from tests.sglang_cpu.install import DEFAULT_RELEASE, venv_python
from tests.sglang_cpu.models import tiny_model_dir
from tests.sglang_cpu.server import lora_flags, start_sglang, start_sglang_servers

ENABLED = os.environ.get("ASYNCRL_SGLANG_TESTS") == "1"
SLICE = "sglang_slice"
HERE = "tests/sglang/"
API_KEY = "sglang-api-key-0123456789abcdef"
ADMIN_KEY = "sglang-admin-key-0123456789abcdef"
DEMO_MODEL = Path(__file__).resolve().parents[2] / "asyncrl" / "models" / "assets" / "tiny-arith"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{SLICE}: a real-SGLang test that ./dev test runs too (the CI slice)")


SLICE_NODEIDS = ("tests/sglang/test_faults.py::test_engine_killed_mid_sync_is_quarantined_and_rejoins_at_the_right_version[0.5.23]",)
"""Tests of tests/sync run here that are in the slice too (a marker would mark every release)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENABLED:
        return
    kept, deselected = [], []
    for item in items:
        in_slice = item.get_closest_marker(SLICE) is not None or item.nodeid in SLICE_NODEIDS
        outside_slice = item.nodeid.startswith(HERE) and not in_slice
        (deselected if outside_slice else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


OLDER_RELEASE = "0.5.18"
"""The release before 0.5.20 the tier also runs on (issue 45 item 8): aborts re-sent, no weight
sessions, no spans, an older LoRA stack; its torch pin (2.13.0) installs here."""


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The default release's venv interpreter (built on first use; a failed build fails the test)."""
    return venv_python(DEFAULT_RELEASE)


@pytest.fixture(scope="module", params=[DEFAULT_RELEASE, OLDER_RELEASE])
def sglang_release(request) -> str:
    """The release a test of tests/sync imported here runs against: each runs on both."""
    venv_python(request.param)
    return request.param


def stop_all(engines: list[Engine]) -> None:
    for engine in engines:  # all told at once: each may sit out its graceful shutdown
        engine.proc.signal(signal.SIGTERM)
    for engine in engines:
        engine.stop()
    from tests.sglang_cpu.server import assert_no_stand_in_called

    for engine in engines:  # no kernel the stand-in only names was called (issue 66 W5)
        assert_no_stand_in_called(engine.proc.log_path)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """``builtin:tiny`` as a directory (tests/sglang_cpu/models.py): what tests/sync's engines serve."""
    return tiny_model_dir()


@pytest.fixture
def engines(sglang_release, tiny_dir, tmp_path) -> list[Engine]:
    """Two real SGLang servers without keys serving ``builtin:tiny``: the ``engines`` of
    tests/sync, so its fault tests run unchanged against SGLang (tests/sglang/test_faults.py)."""
    started = start_sglang_servers(tmp_path, tiny_dir, count=2, name="engine", release=sglang_release)
    try:
        yield started
    finally:
        stop_all(started)


@pytest.fixture
def restart_engine(sglang_release, tiny_dir, tmp_path):
    """tests/sync's ``restart_engine``: a real SGLang server started again on ``port``."""
    return lambda port, name: start_sglang(tmp_path, tiny_dir, port=port, name=name, release=sglang_release)


LORA_FLAGS = lora_flags(8, targets=("q_proj", "v_proj"))


@pytest.fixture
def lora_and_plain(sglang_release, tiny_dir, tmp_path) -> list[Engine]:
    """tests/sync/test_adapter_sync.py's engines on real SGLang: one serving LoRA adapters
    (torch-native LoRA backend, rank up to 8 on q_proj and v_proj), one without LoRA."""
    started = []
    try:
        started.append(start_sglang(tmp_path, tiny_dir, *LORA_FLAGS, name="lora-engine", release=sglang_release))
        started.append(start_sglang(tmp_path, tiny_dir, name="plain-engine", release=sglang_release))
        yield started
    finally:
        stop_all(started)


@pytest.fixture
def lora_engine(sglang_release, tiny_dir, tmp_path) -> Engine:
    """tests/sync/test_adapter_resume.py's engine on real SGLang."""
    with start_sglang(tmp_path, tiny_dir, *LORA_FLAGS, name="lora-engine", release=sglang_release) as engine:
        yield engine


@pytest.fixture
def restart_lora_engine(sglang_release, tiny_dir, tmp_path):
    return lambda port, name: start_sglang(tmp_path, tiny_dir, *LORA_FLAGS, port=port, name=name, release=sglang_release)


@pytest.fixture(scope="session")
def warm_model() -> Path:
    """tests/rollout's warm tiny model (it calls the calculator): what its ``warm_engine`` serves."""
    from tests.helpers.warm_model import warm_tiny_model

    return warm_tiny_model()


@pytest.fixture(scope="module")
def warm_engine(sglang_release, warm_model, tmp_path_factory) -> str:
    """tests/rollout's ``warm_engine`` on real SGLang: the URL of a server serving the warm model."""
    with start_sglang(tmp_path_factory.mktemp("warm-sglang"), warm_model, name="warm-sglang", release=sglang_release) as engine:
        yield engine.url


@pytest.fixture
def sglang_pair(sglang_python, tmp_path) -> list[Engine]:
    """Two real SGLang servers serving the demo model, with an API key and an admin key, started
    for the test: a run must not begin on weights an earlier run left them (its sync agent would
    quarantine them and take back the calls in flight, as it should, and the test would compare
    calls its rollout never used)."""
    engines = start_sglang_servers(tmp_path / "sglang-logs", DEMO_MODEL, count=2, api_key=API_KEY,
                                   admin_api_key=ADMIN_KEY)
    try:
        yield engines
    finally:
        stop_all(engines)
