"""``python -m tests.sglang_cpu install [RELEASE ...]``: build the venvs (``./dev sglang-venv``).
``python -m tests.sglang_cpu serve [--release R] [--port P] MODEL_DIR [SGLANG FLAGS ...]``: run one
CPU server in the foreground (what a user does to try ``engines.backend = "sglang"`` here)."""

from __future__ import annotations

import argparse
import os
import sys

from tests.sglang_cpu.install import DEFAULT_RELEASE, SGLangVenvError, venv_python
from tests.sglang_cpu.server import cpu_flags, server_env


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sglang_cpu", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    inst = sub.add_parser("install", help="build the SGLang venv of each release (cached)")
    inst.add_argument("releases", nargs="*", default=[DEFAULT_RELEASE])
    serve = sub.add_parser("serve", help="run a CPU SGLang server in the foreground")
    serve.add_argument("--release", default=DEFAULT_RELEASE)
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--tp-size", type=int, default=1)
    serve.add_argument("model_dir")
    ns, rest = parser.parse_known_args(argv)
    try:
        if ns.cmd == "install":
            for release in ns.releases:
                print(f"sglang-cpu {release}: {venv_python(release)}")
            return 0
        python = venv_python(ns.release)
    except SGLangVenvError as exc:
        print(f"sglang-cpu: {exc}", file=sys.stderr)
        return 1
    args = [str(python), "-m", "sglang.launch_server", "--model-path", ns.model_dir, "--host", "127.0.0.1",
            "--port", str(ns.port), "--tp-size", str(ns.tp_size), *cpu_flags(), *rest]
    os.execve(str(python), args, server_env(ns.tp_size))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
