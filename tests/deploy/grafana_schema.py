"""Grafana's own dashboard types, for checking the provisioned dashboard where Grafana cannot run.

No registry reachable here ships Grafana itself (tests/deploy/test_compose_run.py skips its
live check), but Grafana publishes its dashboard schema as TypeScript types in the npm package
``@grafana/schema``, at the same version as the server. :func:`dashboard_errors` writes the
dashboard as a TypeScript object literal that must ``satisfies Dashboard`` (so every field,
nested panels, grid positions and targets included, is checked against Grafana's types,
with excess-property checks: a misspelled key is an error) and compiles it with ``tsc``.

The packages are installed once with npm into ``$ASYNCRL_CACHE_DIR/npm/grafana-schema-<v>``
(the version of the ``grafana/grafana`` image compose.yaml names). :func:`schema_dir` answers
the reason instead when npm is missing or the install fails.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from asyncrl.models.smollm2 import cache_dir
from tests.deploy.conftest import REPO

TYPESCRIPT = "5.9.2"  # the version @grafana/schema itself is built with
NPM_TIMEOUT_S = 300
TSC_TIMEOUT_S = 120


def grafana_version() -> str:
    m = re.search(r"grafana/grafana:([0-9][0-9.]*)", (REPO / "compose.yaml").read_text())
    assert m, "compose.yaml names no grafana/grafana image"
    return m.group(1)


def schema_dir() -> Path | str:
    """The npm project holding @grafana/schema and typescript, or why there is none."""
    version = grafana_version()
    root = cache_dir() / "npm" / f"grafana-schema-{version}"
    if (root / "node_modules" / ".bin" / "tsc").exists() and (root / "node_modules" / "@grafana" / "schema").is_dir():
        return root
    npm = shutil.which("npm")
    if npm is None:
        return "npm is not installed: it installs @grafana/schema, Grafana's dashboard types"
    root.mkdir(parents=True, exist_ok=True)
    (root / "package.json").write_text(json.dumps({"name": "asyncrl-dashboard-check", "private": True,
                                                   "dependencies": {"@grafana/schema": version, "typescript": TYPESCRIPT}}))
    proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--silent"], cwd=root, capture_output=True, text=True,
                          timeout=NPM_TIMEOUT_S)
    if proc.returncode != 0:
        return f"npm install @grafana/schema@{version} failed: {proc.stderr.strip()[-500:]}"
    return root


def dashboard_errors(root: Path, dashboard: dict, name: str = "dashboard") -> list[str]:
    """tsc's errors for ``dashboard`` against Grafana's ``Dashboard`` type ([] when it satisfies it)."""
    source = root / f"{name}.ts"
    source.write_text('import type { Dashboard } from "@grafana/schema";\n'
                      f"const dashboard = {json.dumps(dashboard, indent=1)} satisfies Dashboard;\nexport default dashboard;\n")
    proc = subprocess.run([str(root / "node_modules" / ".bin" / "tsc"), "--noEmit", "--strict", "--skipLibCheck",
                           "--moduleResolution", "bundler", "--module", "esnext", "--target", "es2022", source.name],
                          cwd=root, capture_output=True, text=True, timeout=TSC_TIMEOUT_S)
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "error TS" in line]
