"""docs/architecture.md's component table cannot drift (issue 68 item 4): every module path it
names exists, every config section it names is one of ``RunConfig``'s (a dotted name down to a
field; ``prefix_*`` one or more fields), and every top-level room of each service (a
sub-package of ``rollout_service``, ``trainer_daemon``, ``sync_agent``) appears in it. A planted
untrue row is caught."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from asyncrl.config.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SERVICES = ("rollout_service", "trainer_daemon", "sync_agent")
PATH = re.compile(r"^[A-Za-z0-9_./-]+(/|\.py|\.ya?ml)$")


def component_rows(text: str) -> list[list[str]]:
    """The cells of each row of the table under "## Components" (header and rule left out)."""
    section = text.split("## Components", 1)[1]
    rows = []
    for line in section.splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("component", "---"):
            continue
        rows.append(cells)
    return rows


def _section_problem(name: str) -> str | None:
    model: type[BaseModel] = RunConfig
    parts = name.split(".")
    for i, part in enumerate(parts):
        fields = model.model_fields
        if part.endswith("*"):
            if i != len(parts) - 1 or not any(f.startswith(part[:-1]) for f in fields):
                return f"config {name!r}: no field matches {part!r}"
            return None
        if part not in fields:
            return f"config {name!r}: {part!r} is not a field of {model.__name__}"
        annotation = fields[part].annotation
        if i < len(parts) - 1:
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return f"config {name!r}: {part!r} has no fields below it"
            model = annotation
    return None


def index_problems(text: str) -> list[str]:
    """Every untrue thing the component table says (module docstring)."""
    problems, named = [], []
    rows = component_rows(text)
    if not rows:
        return ["docs/architecture.md has no component table"]
    for cells in rows:
        if len(cells) != 5:
            problems.append(f"row {cells[0]!r}: {len(cells)} cells, not 5")
            continue
        component, module, config = cells[:3]
        paths = [p for p in re.findall(r"`([^`]+)`", module) if PATH.match(p)]
        if not paths:
            problems.append(f"row {component!r}: names no module path")
        for path in paths:
            named.append(path)
            if not (ROOT / path).exists():
                problems.append(f"row {component!r}: {path} does not exist")
        for section in re.findall(r"`([^`]+)`", config):
            problem = _section_problem(section)
            if problem:
                problems.append(f"row {component!r}: {problem}")
    for service in SERVICES:
        for room in sorted(p.name for p in (ROOT / service).iterdir() if p.is_dir() and (p / "__init__.py").exists()):
            prefix = f"{service}/{room}/"
            if not any(path.startswith(prefix) for path in named):
                problems.append(f"{prefix} (a room of {service}) appears in no row")
    return problems


def test_the_component_table_says_only_true_things():
    assert index_problems(DOC.read_text()) == []


def test_a_planted_untrue_row_is_caught():
    text = DOC.read_text()
    rule = "|---|---|---|---|---|\n"
    planted = text.replace(rule, rule + "| ghost | `rollout_service/ghost.py` | `algorithm`, `actor.nope` | x | y |\n", 1)
    found = index_problems(planted)
    assert any("rollout_service/ghost.py does not exist" in p for p in found), found
    assert any("'algorithm' is not a field of RunConfig" in p for p in found), found
    assert any("'nope' is not a field of ActorConfig" in p for p in found), found
    gone = text.replace("`trainer_daemon/observe/`", "`trainer_daemon/metrics.py`")
    assert any("trainer_daemon/observe/ (a room of trainer_daemon) appears in no row" in p for p in index_problems(gone))
