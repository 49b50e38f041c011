"""The whole tree passes ruff with the project's rules (pyproject.toml), including the
security rules S307 (eval), S102 (exec) and S301 (pickle) on code that touches model output
and the network; and asyncrl/ imports no component (rollout_service, trainer_daemon,
sync_agent) at module level."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


def test_ruff_is_clean():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


# The packages that build on asyncrl; asyncrl itself may reach them only lazily (inside a
# function, e.g. a CLI subcommand), never when a module of it is imported.
COMPONENTS = ("rollout_service", "trainer_daemon", "sync_agent")


def _module_level_imports(tree: ast.AST):
    """Import statements that run when the module is imported: everything outside function
    bodies (class bodies, ``if``/``try`` blocks and ``if TYPE_CHECKING:`` included)."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            yield node, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node, [node.module]
        stack.extend(ast.iter_child_nodes(node))


def test_asyncrl_imports_no_component_at_module_level():
    """Dependencies point down: asyncrl/ (CLI, config, wire contracts, launching) wires the
    components through their entry points and must not import their internals when loaded
    (DEVELOPERS.md, "Layout")."""
    root = Path(__file__).resolve().parents[1]
    bad = []
    for path in sorted((root / "asyncrl").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, names in _module_level_imports(tree):
            hits = [n for n in names if n.split(".")[0] in COMPONENTS]
            if hits:
                bad.append(f"{path.relative_to(root)}:{node.lineno} imports {', '.join(hits)}")
    assert not bad, "module-level imports of components in asyncrl/ (import them inside the function that needs them):\n" + "\n".join(bad)


def test_the_lint_sees_module_level_but_not_lazy_imports():
    source = (
        "import os\nfrom rollout_service.app import create_app\n"
        "if True:\n    import trainer_daemon.sft\n"
        "class A:\n    import sync_agent\n"
        "def cli():\n    from rollout_service.__main__ import main\n"
    )
    found = sorted(names[0] for _, names in _module_level_imports(ast.parse(source)))
    assert found == ["os", "rollout_service.app", "sync_agent", "trainer_daemon.sft"]
