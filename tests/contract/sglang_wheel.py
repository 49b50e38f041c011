"""SGLang's source, per release, as the contract kit reads it (tests/contract/sglang_source.py).

SGLang cannot be installed here (CUDA wheels), so ``source_dir(version)`` runs
``python -m pip download --no-deps --no-build-isolation <WHEEL_TAGS> sglang==VERSION`` (pip's
own config, so PIP_INDEX_URL / pip.conf apply; at most DOWNLOAD_TIMEOUT_S), extracts a handful
of source files from the wheel into ``$ASYNCRL_CACHE_DIR/sglang-src-<LAYOUT>/VERSION/`` (default
``~/.cache/asyncrl``) under a file lock, atomically (temp dir, then rename, ``COMPLETE`` marker
inside), and deletes the wheel. Later calls only read the cache (no pip, no network). Refresh:
``rm -rf ~/.cache/asyncrl/sglang-src-*/VERSION``. To pin a new version, add it to ``PINNED`` and
run ``pytest tests/contract``. A failed download raises SGLangSourceError saying what failed
and how to fix it.

Besides the sources: behaviour facts read from the wheel at extraction (``behaviour_facts``),
a class's annotated fields without executing its module (``model_fields``) and the wheel's
exact pins (``requires_dist``).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from asyncrl.models.cache import MARKER, build_once
from local_engine.compat import SUPPORTED

PINNED = ("0.5.18", "0.5.23")
SUPPORTED_RELEASES = tuple(f"0.5.{n}" for n in range(SUPPORTED[0][2], SUPPORTED[1][2] + 1))
"""Every release asyncrl claims (local_engine's range; test_release_facts.py: all 0.5.x)."""
DOWNLOAD_TIMEOUT_S = 240  # under the 300 s per-test timeout, so its message is the one seen
# SGLang ships only CPython manylinux_2_34 wheels (no sdist): ask for one fixed tag so every
# machine (macOS, older glibc, another Python) fetches the same file. Only its .py files are read.
WHEEL_TAGS = ("--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
              "--platform", "manylinux_2_34_x86_64")
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
SERVER_ARGS = "sglang/srt/server_args.py"  # launch flags (tests/contract/test_launch_flags.py)
FUNCTION_CALL_PARSER = "sglang/srt/function_call/function_call_parser.py"  # --tool-call-parser names
API_TYPES = "sglang/api/v1/api_types.py"  # 0.5.22+: the schema decoder of the /generate contract gate (msgspec only)
WEIGHT_CHECKER = "sglang/srt/utils/weight_checker.py"  # /weights_checker's answer models (read, not executed: it imports torch)
LAYOUT = "v7"  # bump when the extracted files change: caches of an older layout are rebuilt
METADATA = "METADATA"  # the wheel's dist-info METADATA, kept beside the sources
FACTS = "facts.json"  # behaviour read from the wheel's source (_behaviour_facts)
# Modules io_struct imports from that are light enough to execute (stdlib, msgspec, pydantic).
EXECUTED_MODULES = ("sglang.srt.utils.msgspec_utils", "sglang.srt.utils.field_validators")


class SGLangSourceError(RuntimeError):
    """SGLang's source could not be obtained (download or wheel layout)."""


def cache_dir() -> Path:
    return Path(os.environ.get("ASYNCRL_CACHE_DIR") or Path.home() / ".cache" / "asyncrl") / f"sglang-src-{LAYOUT}"


def source_dir(version: str) -> Path:
    """The extracted source files of sglang==version (downloaded once, then cached)."""
    return build_once(cache_dir() / version, functools.partial(_build, version))


def _build(version: str, out: Path) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{version}-") as tmp:
        wheel = _download(version, Path(tmp) / "wheel")
        stage = Path(tmp) / "src"
        _extract(wheel, stage)
        (stage / MARKER).write_text(wheel.name + "\n")
        shutil.rmtree(out, ignore_errors=True)  # a stale partial dir; we hold the lock
        os.replace(stage, out)


def _download(version: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", *WHEEL_TAGS,
           "--disable-pip-version-check", "-d", str(dest), f"sglang=={version}"]
    fix = (f"The SGLang contract tests read SGLang's source from its PyPI wheel: give this "
           f"machine access to PyPI (or a mirror via PIP_INDEX_URL), or fill the cache "
           f"{cache_dir() / version} on a machine that has it (ASYNCRL_CACHE_DIR moves it).")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except (subprocess.TimeoutExpired, OSError) as exc:
        raise SGLangSourceError(f"`{' '.join(cmd)}` failed: {exc}. {fix}") from exc
    if proc.returncode != 0:
        raise SGLangSourceError(f"`{' '.join(cmd)}` exited with {proc.returncode}: "
                                f"{(proc.stderr or proc.stdout)[-1500:].strip()}\n{fix}")
    wheels = sorted(dest.glob("sglang-*.whl"))
    if not wheels:
        raise SGLangSourceError(f"pip downloaded no sglang wheel for {version} into {dest}: "
                                f"{sorted(p.name for p in dest.iterdir())}. {fix}")
    return wheels[0]


def module_file(module: str, names: set[str]) -> str:
    base = module.replace(".", "/")
    for candidate in (base + ".py", base + "/__init__.py"):
        if candidate in names:
            return candidate
    raise SGLangSourceError(f"the sglang wheel has no source for {module}; update the kit")


def _extract(wheel: Path, stage: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        wanted = [HTTP_SERVER, IO_STRUCT, SAMPLING_PARAMS, SERVER_ARGS, FUNCTION_CALL_PARSER]
        wanted += [module_file(m, names) for m in EXECUTED_MODULES]
        wanted += sorted(n for n in names if n.startswith("sglang/srt/arg_groups/") and n.endswith(".py"))
        missing = [w for w in wanted if w not in names]
        if missing:
            raise SGLangSourceError(f"{wheel.name} lacks {missing}: SGLang moved them; update the kit")
        server = ast.parse(zf.read(HTTP_SERVER))
        wanted += [module_file(module, names) for module, _, _ in included_routers(server)]
        wanted += [API_TYPES] if API_TYPES in names else []  # optional: releases before the gate have none
        wanted += [WEIGHT_CHECKER] if WEIGHT_CHECKER in names else []
        for member in wanted:
            target = stage / member
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(member))
        metadata = [n for n in names if n.endswith(".dist-info/METADATA")]
        if len(metadata) != 1:
            raise SGLangSourceError(f"{wheel.name} has {len(metadata)} METADATA files; update the kit")
        (stage / METADATA).write_bytes(zf.read(metadata[0]))
        (stage / FACTS).write_text(json.dumps(_behaviour_facts(zf, names), sort_keys=True))


def _behaviour_facts(zf: zipfile.ZipFile, names: set[str]) -> dict[str, bool]:
    """What differs by release in behaviour asyncrl depends on, read from the wheel's source:

    - ``abort_once``: the tokenizer passes one exact-rid abort per request (``abort_sent``);
    - ``weight_version_spans``: the scheduler's output path computes ``weight_versions`` spans
      (``compute_weight_version_spans``) for finished requests;
    - ``sampling_mask``: ``GenerateReqInput`` has ``return_sampling_mask`` (each output token's
      sampling support and behaviour log-prob);
    - ``sampling_mask_cap``: the server has ``--sampling-mask-max-tokens`` (a larger support
      aborts the request), in its argument groups or ``server_args.py``;
    - ``sampling_logprobs_mode``: ``GenerateReqInput`` has ``sampling_logprobs_mode``."""
    def source(name: str) -> str:
        return zf.read(name).decode(errors="replace") if name in names else ""

    managers = [n for n in names if n.startswith("sglang/srt/managers/") and n.endswith(".py")]
    return {
        "abort_once": "abort_sent" in source("sglang/srt/managers/tokenizer_manager.py"),
        "weight_version_spans": any("compute_weight_version_spans(" in source(n) for n in managers),
        "sampling_mask": "return_sampling_mask:" in _class_source(source(IO_STRUCT), "GenerateReqInput"),
        "sampling_mask_cap": any("sampling_mask_max_tokens:" in source(n) for n in names
                                 if n == SERVER_ARGS or n.startswith("sglang/srt/arg_groups/")),
        "sampling_logprobs_mode": "sampling_logprobs_mode:" in _class_source(source(IO_STRUCT), "GenerateReqInput"),
    }


def _class_source(text: str, cls: str) -> str:
    """The source of class ``cls`` in ``text`` ("" when absent)."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return ast.get_source_segment(text, node) or ""
    return ""


def behaviour_facts(version: str) -> dict[str, bool]:
    """:func:`_behaviour_facts` of sglang==version (cached with its source)."""
    return json.loads((source_dir(version) / FACTS).read_text())


def model_fields(version: str, path: str, cls: str) -> dict[str, str] | None:
    """The annotated fields of class ``cls`` in the release's file ``path`` (name → annotation
    source), read from the source without executing it; None when the file or class is absent."""
    file = source_dir(version) / path
    if not file.is_file():
        return None
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {s.target.id: ast.unparse(s.annotation) for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return None


def requires_dist(version: str, package: str) -> str | None:
    """The exact version sglang==version's wheel pins ``package`` to (``Requires-Dist:
    package==X`` of its METADATA, markers aside), None when it pins none."""
    pattern = re.compile(rf"^Requires-Dist:\s*{re.escape(package)}\s*==\s*([^\s;,]+)", re.IGNORECASE)
    for line in (source_dir(version) / METADATA).read_text(errors="replace").splitlines():
        if m := pattern.match(line):
            return m.group(1)
    return None


def included_routers(tree: ast.Module) -> list[tuple[str, str, str]]:
    """(module, router name there, prefix) for each ``app.include_router(imported_name)``."""
    imported = {a.asname or a.name: (n.module, a.name) for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
    out = []
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "include_router"
                and is_name(n.func.value, "app") and n.args and isinstance(n.args[0], ast.Name)):
            module, name = imported[n.args[0].id]
            prefix = next((static_str(k.value) for k in n.keywords if k.arg == "prefix"), "")
            out.append((module, name, prefix or ""))
    return out


def is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def static_str(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(node.func, ast.Attribute)
            and ast.unparse(node.func) in ("os.environ.get", "os.getenv")):
        return static_str(node.args[1])
    return None
