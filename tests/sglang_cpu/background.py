"""Start the SGLang venv's build in the background as soon as a session collects a real-SGLang
test (tests/conftest.py), so the 3-5 minute first build overlaps the suite's other tests.

Once per session (an exclusive file in the suite's background directory, shared by the xdist
workers, tests/helpers/shipped_rebuild.py); the child runs ``python -m tests.sglang_cpu install``,
which holds the build lock (``asyncrl.models.cache.build_once``): a test that needs the venv
waits on that lock, and builds it itself (failing with the reason) if the background build
failed. The output is ``<background dir>/sglang-venv.log``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from asyncrl.models.cache import MARKER
from tests.sglang_cpu.install import DEFAULT_RELEASE, venv_dir

TIER_DIR = "tests/sglang/"


def venv_built(release: str = DEFAULT_RELEASE) -> bool:
    """Whether ``release``'s venv is finished (its ``COMPLETE`` marker written last)."""
    return (venv_dir(release) / MARKER).is_file()


def start(background_dir: Path, release: str = DEFAULT_RELEASE) -> None:
    if venv_built(release):
        return
    try:
        fd = os.open(background_dir / "sglang-venv-started", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with (background_dir / "sglang-venv.log").open("w") as log:
        subprocess.Popen([sys.executable, "-m", "tests.sglang_cpu", "install", release], stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, env=env, cwd=root, start_new_session=True)
