"""Every shell command in README.md and ``docs/*.md`` runs as written (issue 64 item 3).

Each shell block (``tests/helpers/doc_blocks.py``: what counts, how a console block's shown
output is checked) runs from the repository root with ``.venv/bin`` first on ``PATH``, against
one live run of the demo started by ``./dev up``, with the placeholders a reader fills in by
hand filled: the run's ``run.env`` (``$ROLLOUT_URL``, ``$ADMIN_TOKEN``, ``$ENGINE_URL``...) is in
the environment, ``runs/demo`` is that run's directory, and ``http://127.0.0.1:30000`` (the
engine docs/local_engine.md starts by hand) an engine of the test's own. Scripts run
under ``set -euo pipefail`` with ``curl`` failing on an HTTP error (``--fail-with-body``): a
command that answers 4xx or 5xx fails its block. A block marked ``<!-- not run here: reason -->``
is listed with its reason instead (GPU, Docker, a run of its own). Blocks that run ``asyncrl
audit`` run last, after Ctrl-C has stopped the run, as the docs do.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.helpers.doc_blocks import Block, doc_files, missing_output, shell_blocks
from tests.helpers.processes import start_engine
from tests.helpers.user_runs import REPO, DevUp

BLOCKS = [b for path in doc_files(REPO) for b in shell_blocks(path)]
AFTER_THE_RUN = "asyncrl audit"  # the docs run the audit after the run ("and after it"): those blocks go last
RUN = sorted((b for b in BLOCKS if b.not_run is None), key=lambda b: AFTER_THE_RUN in b.text)
STANDALONE_ENGINE = "http://127.0.0.1:30000"  # the address docs/local_engine.md starts its engine at
STACK_READY_S = 300.0
BLOCK_S = 240.0  # the slowest run block: the SmolLM2 conversion on a cold cache
STRICT = "set -euo pipefail\ncurl() { command curl --fail-with-body \"$@\"; }\n"  # a script: any failure fails it


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """The demo, as ``./dev up`` runs it, trained a few steps; it runs until the module ends."""
    run = DevUp.start(tmp_path_factory.mktemp("docs") / "demo", "rollout.total_rollout_steps=100000")
    try:
        run.wait_until(lambda: run.steps() >= 2 and run.syncs_succeeded() >= 1, STACK_READY_S, "2 steps and a sync")
        yield run
        run.stop()
    finally:
        run.kill()


@pytest.fixture(scope="module")
def standalone_engine(tmp_path_factory):
    """The engine docs/local_engine.md starts (``asyncrl engine --model builtin:tiny --port 30000``)
    on a free port: its curl examples pause, abort and flush it, which the live run's engine is spared."""
    with start_engine(tmp_path_factory.mktemp("engine")) as engine:
        yield engine


def run_env(run: DevUp) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    for line in (run.run_dir / "run.env").read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = shlex.split(value)[0] if value else ""
    return env


def as_written(block: Block, run: DevUp, request: pytest.FixtureRequest) -> str:
    """The block with its placeholders filled: the demo's run directory, the standalone engine."""
    text = block.text.replace("runs/demo", str(run.run_dir))
    if STANDALONE_ENGINE in text:
        text = text.replace(STANDALONE_ENGINE, request.getfixturevalue("standalone_engine").url)
    return text


def shell(script: str, env: dict[str, str], strict: bool, timeout_s: float = BLOCK_S) -> subprocess.CompletedProcess:
    """A console step runs as typed (its output is the check); a script under ``STRICT``."""
    return subprocess.run(["bash", "-c", (STRICT if strict else "") + script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(STACK_READY_S + BLOCK_S * 2)
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_a_documented_command_runs_as_written(block: Block, live_run: DevUp, request):
    env = run_env(live_run)
    if AFTER_THE_RUN in block.text:
        live_run.stop()
    for command, expected in Block(block.path, block.line, block.tag, as_written(block, live_run, request), None).steps():
        done = shell(command, env, strict=not block.console)
        said = done.stdout + done.stderr
        if block.console:
            missing = missing_output(expected, said)
            assert not missing, f"{block.id}: `{command}` did not print {missing}; it printed:\n{said[-3000:]}"
        else:
            assert done.returncode == 0, f"{block.id} failed ({done.returncode}):\n{command}\n--- output:\n{said[-3000:]}"


def test_the_blocks_not_run_here_say_why():
    marked = [b for b in BLOCKS if b.not_run is not None]
    vague = [b.id for b in marked if len(b.not_run) < 12]
    assert not vague, f"'not run here' needs a reason a reader can check: {vague}"
    assert len(RUN) >= 10, [b.id for b in RUN]  # the harness finds the docs' blocks
    assert {b.path.name for b in RUN} >= {"README.md", "config.md"}


def test_console_output_patterns_match_what_they_should():
    assert missing_output(["checkpoint lineage: step <N>", "  lost       0"], "checkpoint lineage: step 41\n  lost 0\n") == []
    assert missing_output(["  lost       0"], "  lost       3\n") == ["  lost       0"]
    assert missing_output(["b", "a"], "a\nb\n") == ["a"]  # in order
    path = Path("x.md")
    block = Block(path, 1, "", "$ echo a \\\n  b\na b\n$ true\n", None)
    assert block.console and block.steps() == [("echo a \\\n  b", ["a b"]), ("true", [])]
