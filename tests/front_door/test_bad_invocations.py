"""``./dev up`` typed wrong: each mistake gets one line naming the cause and the fix, exit
status 2, no traceback, and nothing started (no process of the run, no run directory).

A second ``./dev up`` on a directory in use is refused the same way; that case needs a live
run and is checked beside the two demo runs in ``test_dev_up.py``.
"""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.helpers.processes import processes_mentioning
from tests.helpers.user_runs import REPO

REFUSAL_S = 120.0  # ./dev's install check and the config's load; nothing else runs


def dev_up(tmp_path, *args: str) -> tuple[int, str, str]:
    run_dir = tmp_path / "run"
    done = subprocess.run(["./dev", "up", *args, f"run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True,
                          timeout=REFUSAL_S, stdin=subprocess.DEVNULL)
    assert not run_dir.exists(), "nothing is started or written for a refused invocation"
    assert processes_mentioning(str(run_dir)) == []
    return done.returncode, done.stdout, done.stderr


def one_line_refusal(rc: int, out: str, err: str) -> str:
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err, err
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_port_already_taken_names_the_key_and_the_fix(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = one_line_refusal(*dev_up(tmp_path, f"rollout.port={port}"))
    assert f"rollout.port={port} is in use on 127.0.0.1" in line and "leave rollout.port unset" in line, line


def test_one_port_named_for_two_services(tmp_path):
    from asyncrl.listen_ports import free_port

    port = free_port()
    line = one_line_refusal(*dev_up(tmp_path, f"rollout.port={port}", f"sync.port={port}"))
    assert f"sync.port={port} is also rollout.port: two services cannot listen on one port" in line, line


def test_a_config_file_that_does_not_exist(tmp_path):
    line = one_line_refusal(*dev_up(tmp_path, str(tmp_path / "my_run.toml")))
    assert f"config file {tmp_path / 'my_run.toml'} does not exist" in line, line


def test_a_misspelt_example_names_the_one_meant(tmp_path):
    line = one_line_refusal(*dev_up(tmp_path, "examples/smollm2_chainsum.toml"))
    assert "examples/smollm2_chainsum.toml does not exist; did you mean examples/smollm2_chain_sum.toml" in line, line


def test_a_typo_inside_an_example_names_the_key_its_file_and_the_right_key(tmp_path):
    text = (REPO / "examples" / "smollm2_chain_sum.toml").read_text()
    assert "temperature = 1.0" in text
    mine = tmp_path / "mine.toml"
    mine.write_text(text.replace("temperature = 1.0", "temprature = 1.0"))
    line = one_line_refusal(*dev_up(tmp_path, str(mine)))
    assert "rollout.sampling.temprature: unknown key" in line and "did you mean 'temperature'" in line, line
    assert f"from file {mine}" in line, line


@pytest.mark.parametrize("override,expected", [
    ("rollout.nn=3", "rollout.nn: unknown key (Extra inputs are not permitted) in rollout; did you mean 'n'?"),
    ("rollout.n=0", "rollout.n: Input should be greater than or equal to 1 (got '0' from argument 'rollout.n=0'); "
                    "allowed range [1, 1024]"),
    ("rollout.sampling.top_p=2", "rollout.sampling.top_p: Input should be less than or equal to 1 (got '2' from argument "
                                 "'rollout.sampling.top_p=2'); allowed range (0.0, 1.0]"),
    ("rollout.n", "config file rollout.n does not exist; an override needs a value: rollout.n=<value>"),
    ("rollout.n=1 rollout.n", "argument 'rollout.n' is not of the form section.key=value"),
])
def test_a_bad_override_names_the_key_its_source_and_the_allowed_values(tmp_path, override, expected):
    line = one_line_refusal(*dev_up(tmp_path, *override.split()))
    assert line.startswith("asyncrl up: ") and expected in line, line
