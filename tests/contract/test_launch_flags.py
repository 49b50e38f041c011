"""The flags ``docker/sglang/engine.sh`` launches SGLang with exist in both pinned releases.

Read from each release's ``server_args.py`` and ``arg_groups/`` (0.5.23 declares most fields
in ``arg_groups/fields/*.py``): a field declared ``tp_size: A[...]`` is the flag ``--tp-size``,
plus every ``"--x"`` string (``aliases=[...]``, ``add_argument``); ``--tool-call-parser`` names are the keys of ``function_call_parser.py``'s detector
table. A flag SGLang does not have (``--tp``) would stop the server at start.
"""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

from tests.contract import sglang_source as kit

REPO = Path(__file__).resolve().parents[2]


def launch_flags(version: str) -> set[str]:
    root = kit.source_dir(version) / "sglang" / "srt"
    flags: set[str] = set()
    for path in [root / "server_args.py", *sorted((root / "arg_groups").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.annotation, ast.Subscript)
                    and isinstance(node.annotation.value, ast.Name) and node.annotation.value.id == "A"):
                flags.add("--" + node.target.id.replace("_", "-"))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--") \
                    and " " not in node.value:
                flags.add(node.value)
    return flags


def tool_call_parsers(version: str) -> set[str]:
    tree = ast.parse((kit.source_dir(version) / kit.FUNCTION_CALL_PARSER).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and any(isinstance(v, ast.Name) and v.id.endswith("Detector") for v in node.values):
            names |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
    return names


def engine_argv(tmp_path: Path, **env: str) -> list[str]:
    run_env = {"PATH": os.environ["PATH"], "ENGINE_MODEL_PATH": "/models/m", "ENGINE_API_KEY": "k", "ENGINE_DRY_RUN": "1",
               "ENGINE_SLOT_DIR": str(tmp_path / "slots"), "ENGINE_ADDR_FILE": str(tmp_path / "addr"),
               "TMPDIR": str(tmp_path), **env}  # TMPDIR: its secrets directory
    out = subprocess.run(["bash", str(REPO / "docker" / "sglang" / "engine.sh")], env=run_env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


@pytest.mark.parametrize("version", kit.SUPPORTED_RELEASES)
def test_engine_sh_uses_only_flags_and_parsers_sglang_has(tmp_path, version):
    flags = launch_flags(version)
    assert {"--tp-size", "--model-path", "--enable-metrics"} <= flags and "--tp" not in flags  # the reader works
    argv = engine_argv(tmp_path, ENGINE_TP="1", ENGINE_GPUS="0")
    used = [a for a in argv if a.startswith("--")]
    assert "--tp-size" in used
    assert set(used) <= flags, set(used) - flags
    parser = argv[argv.index("--tool-call-parser") + 1]
    assert parser in tool_call_parsers(version) and parser == "qwen"


@pytest.mark.parametrize("version", kit.SUPPORTED_RELEASES)
def test_the_flags_docs_deployment_advises_exist(version):
    """docs/deployment.md ("SGLang versions") advises them through ENGINE_EXTRA_ARGS; the sync
    agent requires the in_place pair (asyncrl.sync_control.pause_policy.IN_PLACE_FLAGS), which
    ``asyncrl slurm`` passes, and reads them back from ``/server_info`` under these names."""
    from asyncrl.sync_control.pause_policy import IN_PLACE_FLAGS

    needed = {flag for flag, _ in IN_PLACE_FLAGS.values()}
    assert needed == {"--disable-radix-cache", "--disable-overlap-schedule"}
    assert needed | {"--enable-deterministic-inference", "--enable-return-routed-experts"} <= launch_flags(version)
