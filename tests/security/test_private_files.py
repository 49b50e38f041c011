"""Issue 48 item 5: a run's files are its user's alone. ``atomic_write`` creates 0600 whatever
the umask; ``private_dir`` creates or tightens a directory to 0700; the run-writing commands set
umask 077 first (their whole run directory: tests/loop/test_up.py)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from asyncrl.files import atomic_write, private_dir
from launcher.cli import WRITES_A_RUN


def test_atomic_write_is_private_under_a_permissive_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "answer.json", '{"ground_truth": 42}')
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "answer.json").stat().st_mode) == 0o600


def test_private_dir_creates_and_tightens(tmp_path):
    made = private_dir(tmp_path / "a" / "run")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    private_dir(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_the_run_writing_commands_start_with_umask_077(tmp_path):
    """The umask a command's handler (and so every child it starts) runs under, read by a probe
    put in place of the handler: 077 for a run-writing command, the caller's for the others."""
    probe = ("import os, sys; import launcher.cli as c; "
             "c.COMMANDS['up'] = (lambda argv: print(oct(os.umask(0))) or 0, ''); "
             "c.COMMANDS['config'] = (lambda argv: print(oct(os.umask(0))) or 0, ''); "
             "sys.exit(c.main([sys.argv[1]]))")
    got = {cmd: subprocess.run([sys.executable, "-c", probe, cmd], capture_output=True, text=True, timeout=60,
                               preexec_fn=lambda: os.umask(0o022)).stdout.strip() for cmd in ("up", "config")}
    assert "up" in WRITES_A_RUN and got == {"up": "0o77", "config": "0o22"}
