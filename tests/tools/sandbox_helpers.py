"""Helpers for the tools tests: tight sandbox limits, and /proc scans by uid range.

Every sandbox here uses a test-only ``uid_base`` so that the tests can find every process
a run started (uid in [base, base + pid_max]) without knowing the run's pid in advance.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# distinct from the production default, and per pytest-xdist worker (gw0, gw1, ...): a worker's
# leftover check must not see (and kill) the runs of the tests another worker runs meanwhile
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
TEST_UID_BASE = 1_900_000_000 + _WORKER * 2**23
PID_MAX = int(Path("/proc/sys/kernel/pid_max").read_text())
IS_ROOT = os.geteuid() == 0

# Tight defaults: every adversarial program is stopped in about a second.
TIGHT_LIMITS = dict(
    wall_timeout_s=5.0,
    cpu_time_s=2,
    memory_mb=256,
    max_processes=8,
    max_file_size_mb=1,
    max_output_bytes=4096,
    uid_base=TEST_UID_BASE,
)

root_only = pytest.mark.skipif(not IS_ROOT, reason="per-run uid isolation needs root")


def sandbox_pids(uid_base: int = TEST_UID_BASE) -> dict[int, int]:
    """{pid: uid} of live (non-zombie) processes whose real uid is a sandbox uid."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields["Uid"].split()[0])
        if uid_base <= uid <= uid_base + PID_MAX and not fields["State"].strip().startswith("Z"):
            found[int(entry)] = uid
    return found
