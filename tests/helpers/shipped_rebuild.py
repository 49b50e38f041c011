"""The suite's long builds, started in the background as soon as the suite knows it needs them
(tests/conftest.py), one after the other in one child process:

1. the tests' warm model (tests/helpers/warm_model.py: ~1.5 min alone), into the suite's own
   cache, when a collected test uses the ``warm_model`` fixture: the fixture then finds it
   built, or waits on the same build lock (``asyncrl.models.cache.build_once``) instead of
   building it beside the rebuild below (which made it take over 3 minutes);
2. the shipped demo policy's from-scratch rebuild for tests/recipes/test_warmup_shipped.py,
   into a fresh cache: its first 40 steps (``python -m recipes.demo.warmup --rebuild
   --prefix``, ~1 CPU-minute), or all 550 with ``ASYNCRL_FULL_REBUILD=1`` (``./dev
   test-shipped``: 4 minutes alone on 2 cores, 15-20 CPU-minutes beside the suite, which made it the suite's
   largest single cost).

Both overlap with the many tests that wait on timeouts and sleeps instead of adding to the
suite's wall time. With pytest-xdist, every worker collects the same tests: the first to get
here starts the builds (an exclusive file), the others find them started; all share the
directory the controller made (``ASYNCRL_TEST_BACKGROUND_DIR``, inherited by the workers),
where the builder leaves its output (``out``) and exit status (``rc``). The shipped test waits
for ``rc`` (bounded) in whichever worker runs it. The controller (or the only process) kills
the builder and removes the directory when the session ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TEST_IDS = ("tests/recipes/test_warmup_shipped.py::test_a_rebuild_reproduces_the_shipped_builds_first_steps_bit_for_bit",
            "tests/recipes/test_warmup_shipped.py::test_building_it_again_reproduces_the_shipped_weights")
FULL_ENV = "ASYNCRL_FULL_REBUILD"  # "1": rebuild all the steps (./dev test-shipped), else the prefix
TIMEOUT_S = 1500.0  # the full builds: ~5 min alone on 2 cores; several times that beside the suite
WARM_FIXTURE = "warm_model"
ENV_DIR = "ASYNCRL_TEST_BACKGROUND_DIR"
POLL_S = 1.0

CHILD = """
import os, subprocess, sys
from pathlib import Path
d, warm, rebuild, full = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4] == "1"
rc = 1
try:
    if warm:
        from tests.helpers.warm_model import warm_tiny_model
        warm_tiny_model()
    rc = 0
    if rebuild:
        env = {**os.environ, "ASYNCRL_CACHE_DIR": str(d / "cache")}
        with open(d / "out", "w") as out:
            argv = [sys.executable, "-m", "recipes.demo.warmup", "--rebuild", "--quiet", *([] if full else ["--prefix"])]
            rc = subprocess.run(argv, env=env, stdout=out).returncode
finally:
    (d / "rc.tmp").write_text(str(rc))
    os.replace(d / "rc.tmp", d / "rc")
"""


def full_rebuild() -> bool:
    """Whether this session rebuilds all of the shipped policy's steps (``ASYNCRL_FULL_REBUILD=1``)."""
    return os.environ.get(FULL_ENV) == "1"


@dataclass
class Rebuild:
    dir: Path
    rebuilds: bool

    @property
    def cache(self) -> Path:
        return self.dir / "cache"

    @property
    def log(self) -> Path:
        return self.dir / "background-builds.log"

    def result(self) -> Path:
        """The rebuilt policy's directory (waits for the builds; raises with the log on failure)."""
        if not self.rebuilds:
            raise AssertionError("the shipped policy's rebuild was not started: its test was not collected")
        deadline = time.monotonic() + TIMEOUT_S
        while not (self.dir / "rc").is_file():
            if time.monotonic() > deadline:
                raise AssertionError(f"the background builds did not finish within {TIMEOUT_S:.0f} s; log: {self.log}")
            time.sleep(POLL_S)
        rc = int((self.dir / "rc").read_text())
        if rc != 0:
            raise AssertionError(f"the background builds failed ({rc}): {self.log.read_text()[-2000:]}")
        return Path((self.dir / "out").read_text().strip().splitlines()[-1])


def configure(config: pytest.Config) -> None:
    """``pytest_configure``: the controller (or the only process) makes the shared directory;
    xdist workers inherit it through the environment."""
    if hasattr(config, "workerinput"):
        return
    d = Path(tempfile.mkdtemp(prefix="asyncrl-background-"))
    os.environ[ENV_DIR] = str(d)
    config.add_cleanup(lambda: _stop(d))


def _stop(d: Path) -> None:
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        os.killpg(int((d / "pid").read_text()), signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


def start(config: pytest.Config, warm: bool = False, rebuild: bool = True) -> Rebuild:
    """Start the builds once per session (whichever process gets here first)."""
    d = Path(os.environ[ENV_DIR])
    try:
        fd = os.open(d / "started", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return Rebuild(d, rebuild)
    os.close(fd)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with (d / "background-builds.log").open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(d), "1" if warm else "0", "1" if rebuild else "0",
                                 "1" if full_rebuild() else "0"],
                                stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=root, start_new_session=True)
    (d / "pid").write_text(str(proc.pid))
    return Rebuild(d, rebuild)
