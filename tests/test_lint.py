"""The whole tree passes ruff with the project's rules (pyproject.toml), including the
security rules S307 (eval), S102 (exec) and S301 (pickle) on code that touches model output
and the network; and the imports point down (docs/architecture.md, "Layers"):

    launcher                         the ``asyncrl`` command, ``asyncrl up``
    recipes                          the demo: task, SFT data, warm-up
    rollout_service  trainer_daemon  sync_agent  local_engine     (no imports between the first three)
    tools
    asyncrl                          config, wire, chat, clients, sync_control (torch-free), weight_sync

and the control plane (the rollout service's and the sync agent's apps) never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


def test_ruff_is_clean():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("rollout_service", "trainer_daemon", "sync_agent")
ABOVE_THE_FOUNDATION = (*SERVICES, "local_engine", "tools", "recipes", "launcher")


def _imports(tree: ast.AST, *, lazy: bool = True, type_checking: bool = True):
    """``(node, [module names])`` of the absolute imports in ``tree``: every one, or (``lazy=False``)
    those that run when the module is imported (function bodies left out); ``type_checking=False``
    leaves out ``if TYPE_CHECKING:`` blocks (annotations only)."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield node, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node, [node.module]
        stack.extend(ast.iter_child_nodes(node))


def _violations(package: str, forbidden, **which) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node, names in _imports(ast.parse(path.read_text(), filename=str(path)), **which):
            hits = [n for n in names if forbidden(n)]
            if hits:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {', '.join(hits)}")
    return bad


def _top(name: str) -> str:
    return name.split(".")[0]


def test_the_foundation_imports_nothing_above_it():
    """asyncrl/ is what every service shares: it imports no service, tool, recipe or the
    launcher, not even lazily."""
    bad = _violations("asyncrl", lambda n: _top(n) in ABOVE_THE_FOUNDATION)
    assert not bad, "asyncrl/ reaches up:\n" + "\n".join(bad)


def test_no_service_imports_another():
    bad = []
    for service in SERVICES:
        bad += _violations(service, lambda n, s=service: _top(n) in SERVICES and _top(n) != s)
    assert not bad, "services import each other (share through asyncrl/ instead):\n" + "\n".join(bad)


def test_only_the_launcher_imports_the_launcher():
    bad = []
    for package in ("asyncrl", *ABOVE_THE_FOUNDATION):
        if package != "launcher":
            bad += _violations(package, lambda n: _top(n) == "launcher")
    assert not bad, "\n".join(bad)


def test_no_service_imports_a_recipe():
    """Issue 50 item 4: the demo is the launcher's (it writes the demo task's files and passes
    their paths); the services, local_engine and the tools import no recipe, not even its data."""
    bad = []
    for package in (*SERVICES, "local_engine", "tools"):
        bad += _violations(package, lambda n: _top(n) == "recipes")
    assert not bad, "\n".join(bad)


def test_the_sync_control_package_is_torch_free():
    """Not even for a type (issue 50): the control side names the hosted group by a protocol."""
    bad = _violations("asyncrl/sync_control", lambda n: _top(n) == "torch" or n.startswith("asyncrl.weight_sync"))
    assert not bad, "\n".join(bad)


FIRST_PARTY = ("asyncrl", *SERVICES, "local_engine", "tools", "recipes", "launcher")


def _module_graph() -> dict[str, set[str]]:
    """First-party module → the first-party modules it imports, counting lazy (function-body)
    and ``TYPE_CHECKING`` imports too: a cycle through one is still a cycle to a reader, and
    the eager-only lint missed four (issue 50 item 3). A package's own ``__init__`` is not an
    edge of its submodules."""
    modules: dict[str, Path] = {}
    for package in FIRST_PARTY:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                found = resolve(target)
                if found and found != name and not name.startswith(found + "."):
                    graph[name].add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_import_cycles_even_through_lazy_or_type_checking_imports():
    cycles = _cycles(_module_graph())
    assert not cycles, "import cycles (lazy and TYPE_CHECKING imports counted): " + "; ".join(" <-> ".join(c) for c in cycles)


def _room(module: str) -> str:
    """A module's room: the sub-package or top-level module of its package it lives in."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _room_graph(root: Path = ROOT, packages: tuple[str, ...] = FIRST_PARTY) -> dict[str, set[str]]:
    """Room → the rooms of the same package it imports (lazy, ``TYPE_CHECKING`` and relative
    imports counted). The module graph cannot see a circle between rooms whose modules form no
    cycle (issue 68 item 4)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            modules[".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*here[:len(here) - (node.level - 1)], *([node.module] if node.module else [])])
                if not base:
                    continue
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                found = resolve(target)
                if found is None or name.count(".") == 0 or found.count(".") == 0:
                    continue
                a, b = _room(name), _room(found)
                if a != b and a.split(".")[0] == b.split(".")[0]:
                    graph.setdefault(a, set()).add(b)
                    graph.setdefault(b, set())
    return graph


def test_no_circle_between_the_rooms_of_a_package():
    """Issue 68: inside every package, its rooms (sub-packages and top-level modules) import
    each other in one direction only (the rollout service's agent → api → runner → agent and
    the trainer's policy → sync → state → policy circles were broken up)."""
    cycles = _cycles(_room_graph())
    assert not cycles, "circles between rooms: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_room_lint_sees_a_circle_through_relative_imports(tmp_path):
    for path, text in {"p/__init__.py": "", "p/a/__init__.py": "", "p/a/x.py": "from ..b import y\n",
                       "p/b/__init__.py": "", "p/b/y.py": "def f():\n    from p.c import z\n",
                       "p/c.py": "from .a import x\n"}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    graph = _room_graph(tmp_path, ("p",))
    assert graph == {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}, graph
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_the_cycle_lint_finds_a_cycle_through_a_lazy_import():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_control_plane_apps_load_no_torch():
    """The rollout service and the sync agent never train: importing their apps leaves torch
    unloaded (bench/import_cost.py measures what it saves)."""
    code = ("import sys, rollout_service.app, sync_agent.app, rollout_service.__main__, sync_agent.__main__;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'safetensors')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"loaded by the control plane's apps: {out.stdout[:500]}"


def test_the_lint_sees_lazy_and_type_checking_imports_only_when_asked():
    source = (
        "import os\nfrom rollout_service.app import create_app\n"
        "if TYPE_CHECKING:\n    import torch\n"
        "class A:\n    import sync_agent\n"
        "def cli():\n    from trainer_daemon.sft import sft\n"
    )
    tree = ast.parse(source)
    assert sorted(n[0] for _, n in _imports(tree)) == ["os", "rollout_service.app", "sync_agent", "torch", "trainer_daemon.sft"]
    assert sorted(n[0] for _, n in _imports(tree, lazy=False)) == ["os", "rollout_service.app", "sync_agent", "torch"]
    assert sorted(n[0] for _, n in _imports(tree, lazy=False, type_checking=False)) == ["os", "rollout_service.app", "sync_agent"]


# One wiring point per service (issue 34 item 5): only these take the whole run config; every
# component below them takes the sections it uses (or a settings object a ``from_config`` /
# ``of`` classmethod builds, as StepSettings does), so what a component depends on is in its
# signature. ``build_*`` functions assemble components from the whole config (the publisher,
# the trackers that record the config, the verifiers driver's spec).
WIRING = {
    ("rollout_service/service.py", "RolloutService.__init__"),
    ("rollout_service/build.py", "_assemble"),
    ("rollout_service/__main__.py", "_serve"),
    ("sync_agent/agent.py", "SyncAgent.__init__"),
    ("trainer_daemon/daemon.py", "TrainerDaemon.__init__"), ("trainer_daemon/rank0.py", "Rank0Services.__init__"),
}
SETTINGS_FACTORIES = ("from_config", "of", "for_run")
WHOLE_CONFIG_CHECKED = ("asyncrl", *SERVICES, "local_engine", "tools")


def _takes_whole_config(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    return any((a.annotation is not None and "RunConfig" in ast.unparse(a.annotation))
               or (a.annotation is None and a.arg == "cfg") for a in args)


def _whole_config_takers(tree: ast.AST) -> list[tuple[str, int]]:
    """``(qualified name, line)`` of every function or method in ``tree`` taking a RunConfig
    (annotated so, or an unannotated ``cfg``), settings factories and builders left out."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                if _takes_whole_config(child) and child.name not in SETTINGS_FACTORIES and not child.name.startswith("build"):
                    out.append((name, child.lineno))
                visit(child, f"{name}.")

    visit(tree, "")
    return out


def test_only_a_services_wiring_point_takes_the_whole_run_config():
    bad = []
    for package in WHOLE_CONFIG_CHECKED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel.startswith("asyncrl/config/"):
                continue  # the config itself
            for name, line in _whole_config_takers(ast.parse(path.read_text(), filename=rel)):
                if (rel, name) not in WIRING:
                    bad.append(f"{rel}:{line} {name} takes the whole run config: give it the sections it uses")
    assert not bad, "\n".join(bad)
    missing = [w for w in WIRING if not any(w[1] == n for n, _ in _whole_config_takers(ast.parse((ROOT / w[0]).read_text())))]
    assert not missing, f"wiring points that no longer take the config (drop them from WIRING): {missing}"


def test_the_config_lint_sees_annotated_and_bare_configs():
    tree = ast.parse("class A:\n    def __init__(self, cfg): ...\n    @classmethod\n    def from_config(cls, cfg: RunConfig): ...\n"
                     "def f(sync, actor): ...\ndef g(x, config: 'RunConfig'): ...\ndef build_x(cfg): ...\n"
                     "def h(cfg: SftConfig): ...\n")
    assert _whole_config_takers(tree) == [("A.__init__", 2), ("g", 6)]


def _service_references(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(tree)
            if (isinstance(n, ast.Name) and n.id in ("svc", "RolloutService")) or (isinstance(n, ast.arg) and n.arg == "svc")]


def test_the_rollout_services_routes_depend_on_their_ports_only():
    """Issue 34: the admin, OpenAI and metrics code take narrow ports (``AdminPorts``,
    ``OpenAIContext``, ``MetricsSources``), never the service object: no ``svc``, no
    ``RolloutService`` in them."""
    bad = []
    for package in ("rollout_service/api", "rollout_service/openai"):
        for path in sorted((ROOT / package).rglob("*.py")):
            bad += _service_references(path)
    bad += _service_references(ROOT / "rollout_service/metrics.py")
    assert not bad, "routes reaching the service object:\n" + "\n".join(bad)


def test_the_rollout_service_is_built_by_constructor_injection_only():
    """Issue 34: ``rollout_service/build.py`` hands every component what it needs through its
    constructor; it never sets an attribute of something it built (no patching after
    construction), and the service's constructor only stores what it is given."""
    tree = ast.parse((ROOT / "rollout_service/build.py").read_text())
    patched = []
    for fn in (n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name in ("build", "_assemble")):
        stack = list(fn.body)
        while stack:  # the assembly itself, not the functions it defines (they run later, on their own objects)
            n = stack.pop()
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(n, (ast.Assign, ast.AugAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                patched += [f"build.py:{n.lineno} {ast.unparse(t)}" for t in targets if isinstance(t, ast.Attribute)]
            stack.extend(ast.iter_child_nodes(n))
    assert not patched, "\n".join(patched)
    service = ast.parse((ROOT / "rollout_service/service.py").read_text())
    cls = next(n for n in service.body if isinstance(n, ast.ClassDef) and n.name == "RolloutService")
    assert not [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "_build"]


def test_the_engines_weight_version_string_is_read_and_written_in_few_places():
    """Issue 50 item 1: a weight version is an int in asyncrl; SGLang's string form is made and
    read by the engine client (through asyncrl/wire/sync.py's two functions) and, where a raw
    SGLang answer is read outside it, by those two functions only, never by hand."""
    allowed = {"asyncrl/wire/sync.py", "asyncrl/engine_client/client.py", "asyncrl/engine_client/types.py",
               "sync_agent/fleet.py", "launcher/demo_stack.py"}
    users = set()
    for package in ("asyncrl", *ABOVE_THE_FOUNDATION):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if "weight_version_number" in text or "weight_version_label" in text:
                users.add(str(path.relative_to(ROOT)))
    assert users <= allowed, sorted(users - allowed)
    hand_made = []
    for package in ("asyncrl", *ABOVE_THE_FOUNDATION):
        for path in sorted((ROOT / package).rglob("*.py")):
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                if "weight_version=str(" in line or "new_version=str(" in line or "update_weight_version(str(" in line:
                    hand_made.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert hand_made == [], hand_made


def test_the_engine_pool_takes_no_late_bound_callables():
    """Issue 50 item 2: what the pool knows of the rollout is a ServingState given at build
    time, not closures over a runner bound later: none of its fields is a Callable."""
    import dataclasses

    from rollout_service.engines.pool import EnginePool

    callables = [f.name for f in dataclasses.fields(EnginePool) if "Callable" in str(f.type)]
    assert callables == [], callables


def test_the_trainer_keeps_its_rooms():
    """Issue 50 item 5: the trainer's top level holds its entry points and its loop; every other
    module lives in a room (algo, compute, consume, observe, policy, state, sync)."""
    top = {p.stem for p in (ROOT / "trainer_daemon").glob("*.py")}
    assert top == {"__init__", "__main__", "launch", "torchrun", "daemon", "rank0", "io_loop", "audit", "sft"}, sorted(top)
    rooms = {p.name for p in (ROOT / "trainer_daemon").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == {"algo", "compute", "consume", "observe", "policy", "state", "sync"}, sorted(rooms)
