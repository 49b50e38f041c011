"""The demo policy's from-scratch rebuild for tests/trainer/test_warmup_shipped.py, started in
the background as soon as the suite knows it will run that test (tests/conftest.py,
``pytest_collection_finish``): ~3 CPU-minutes that overlap with the many tests that wait on
timeouts and sleeps, instead of adding to the suite's wall time. The test waits for it
(bounded) and compares the weights. Its state lives on the pytest config's stash.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

TEST_ID = "tests/trainer/test_warmup_shipped.py::test_building_it_again_reproduces_the_shipped_weights"
TIMEOUT_S = 1500.0  # ~180 s alone on 2 cores (portable numerics); several times that beside the suite


@dataclass
class Rebuild:
    proc: subprocess.Popen
    cache: Path
    log: Path

    def result(self) -> Path:
        """The rebuilt policy's directory (waits for the build; raises with its log on failure)."""
        try:
            out, _ = self.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise AssertionError(f"the rebuild did not finish within {TIMEOUT_S:.0f} s; log: {self.log}") from None
        if self.proc.returncode != 0:
            raise AssertionError(f"the rebuild failed ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
        return Path(out.strip().splitlines()[-1])


KEY = pytest.StashKey[Rebuild]()


def start(config: pytest.Config) -> Rebuild:
    """Start the rebuild (once per session) into a fresh cache directory."""
    if KEY in config.stash:
        return config.stash[KEY]
    cache = Path(tempfile.mkdtemp(prefix="asyncrl-rebuild-"))
    log = cache / "rebuild.log"
    env = {**os.environ, "ASYNCRL_CACHE_DIR": str(cache)}
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "trainer_daemon.warmup", "--rebuild", "--quiet"], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)
    config.stash[KEY] = Rebuild(proc, cache, log)

    def cleanup() -> None:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        shutil.rmtree(cache, ignore_errors=True)

    config.add_cleanup(cleanup)
    return config.stash[KEY]
