"""Commands run the way a user types them: ``./dev up`` from the repository root, in its own
process group, its output in a file, stopped with Ctrl-C (SIGINT to the whole group, as a
terminal sends it), and the run directory read back for what the docs promise.

``DevUp.start(run_dir, *args)`` runs ``./dev up *args run.dir=<run_dir>`` (``run.dir`` is the
README's way of giving a run its own directory); ``steps()`` and ``syncs_succeeded()`` read the
trainer's metrics file and the sync agent's history while it runs; ``ctrl_c()`` then
``finish()`` stop it and return its exit code and output; ``summary()`` is the summary it
wrote; ``children_left()`` lists any process of the run still alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.helpers.processes import processes_mentioning
from tests.helpers.waiting import wait_for_sync

REPO = Path(__file__).resolve().parents[2]
CHILDREN_EXIT_S = 10.0  # after asyncrl up returned: its children's SIGTERM → SIGKILL grace is already over


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSONL file a live process appends to (a torn last line skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def children_left(run_dir: Path) -> list[str]:
    """Live processes of the run: every child is started with the run's config file, except
    engines (found by their port)."""
    config = run_dir / "config.yaml"
    urls = (yaml.safe_load(config.read_text())["engines"].get("urls") or []) if config.exists() else []
    needles = [str(run_dir), *(f"--port {u.rsplit(':', 1)[1]} " for u in urls)]  # the space: not --port 400001
    with contextlib.suppress(AssertionError):  # the callers assert on what is left, naming it
        wait_for_sync(lambda: not processes_mentioning(*needles), CHILDREN_EXIT_S, "the run's children to exit")
    return processes_mentioning(*needles)


@dataclass
class DevUp:
    """One ``./dev up`` process (see the module docstring)."""

    run_dir: Path
    proc: subprocess.Popen
    output: Path

    @classmethod
    def start(cls, run_dir: Path, *args: str) -> DevUp:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        output = run_dir.parent / f"{run_dir.name}.{uuid.uuid4().hex[:8]}.out"  # a second ./dev up on the directory: its own
        with open(output, "w") as out:
            proc = subprocess.Popen(["./dev", "up", *args, f"run.dir={run_dir}"], cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return cls(run_dir, proc, output)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def steps(self) -> int:
        return max((int(r["step"]) for r in read_jsonl(self.run_dir / "metrics" / "trainer.jsonl") if "step" in r), default=0)

    def syncs_succeeded(self) -> int:
        rows = read_jsonl(self.run_dir / "sync" / "history.jsonl")
        return sum(1 for r in rows if r.get("event") == "finished" and r.get("state") == "succeeded")

    def wait_until(self, predicate, timeout_s: float, what: str) -> None:
        def check() -> bool:
            if predicate():
                return True
            assert self.proc.poll() is None, f"./dev up exited ({self.proc.returncode}) before {what}:\n{self.text()[-4000:]}"
            return False

        wait_for_sync(check, timeout_s, f"{what} ({self.run_dir})", interval_s=0.5)

    def ctrl_c(self) -> None:
        """What Ctrl-C in a terminal does: SIGINT to every process of the foreground group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def finish(self, timeout_s: float) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"./dev up did not stop within {timeout_s:.0f} s:\n{self.text()[-4000:]}") from None
        return self.proc.returncode, self.text()

    def stop(self, timeout_s: float = 90.0) -> None:
        """Ctrl-C, once, and a clean exit (status 0) within ``timeout_s``."""
        if self.proc.poll() is None:
            self.ctrl_c()
        rc, out = self.finish(timeout_s)
        assert rc == 0, out[-4000:]

    def kill(self) -> None:
        """Clean-up after a failed test: the whole group, at once."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())
