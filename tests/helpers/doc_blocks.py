"""The shell commands the docs show, as blocks a test can run.

A block is a fenced code block of README.md or ``docs/*.md`` tagged ``bash``, ``sh``,
``shell`` or ``console``, or untagged with a first line starting ``$ `` (a command and the
output it prints). Other untagged blocks are diagrams, synopses and outputs; other tags are
files (TOML, YAML, Python).

- A ``bash`` block is a script: every line runs, in order (comments are comments).
- A console block (``console``, or lines starting ``$ ``) is commands and their output: each
  ``$ `` line (with its ``\\`` continuation lines) runs, and the lines after it, up to the next
  ``$ ``, are what it printed: each must appear in the command's output, in order, where ``<…>``
  (any text in angle brackets) and ``…`` stand for anything.

A block is not run when the last non-blank line above it is ``<!-- not run here: REASON -->``;
the reason is shown in the test's report and must say why (GPU, Docker, a second training run).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

SHELL_TAGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^([ \t]*)```([\w-]*)[^\n]*\n(.*?)^\1```", re.M | re.S)  # indented: inside a list item
NOT_RUN = re.compile(r"^<!--\s*not run here:\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    tag: str
    text: str
    not_run: str | None  # the reason, when the block is marked

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"

    @property
    def console(self) -> bool:
        return self.tag == "console" or self.text.lstrip().startswith("$ ")

    def steps(self) -> list[tuple[str, list[str]]]:
        """A console block's (command, expected output lines); a script is one step."""
        if not self.console:
            return [(self.text, [])]
        steps: list[tuple[str, list[str]]] = []
        lines = self.text.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            if not line.startswith("$ "):
                if steps:
                    steps[-1][1].append(line)
                i += 1
                continue
            command = [line[2:]]
            while command[-1].endswith("\\") and i + 1 < len(lines):
                i += 1
                command.append(lines[i])
            steps.append(("\n".join(command), []))
            i += 1
        return steps


def doc_files(repo: Path) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def shell_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        tag, body = match.group(2).lower(), textwrap.dedent(match.group(3))
        if tag not in SHELL_TAGS and not (tag == "" and body.lstrip().startswith("$ ")):
            continue
        before = [line.strip() for line in text[:match.start()].splitlines() if line.strip()]
        marker = NOT_RUN.match(before[-1]) if before else None
        blocks.append(Block(path, text[:match.start()].count("\n") + 1, tag, body, marker.group(1) if marker else None))
    return blocks


def output_pattern(expected: str) -> re.Pattern[str]:
    """An expected output line as a pattern: ``<…>`` and ``…`` match anything, runs of spaces
    any run of spaces, the rest literally."""
    parts = re.split(r"(<[^<>]*>|…|\s+)", expected.strip())
    regex = "".join(".*?" if p.startswith("<") and p.endswith(">") or p == "…" else r"\s+" if p.isspace() and p else
                    re.escape(p) for p in parts)
    return re.compile(regex)


def missing_output(expected: list[str], actual: str) -> list[str]:
    """The expected lines not found in ``actual``, in order (empty: all there)."""
    lines = actual.splitlines()
    at = 0
    missing = []
    for want in (e for e in expected if e.strip()):
        pattern = output_pattern(want)
        found = next((j for j in range(at, len(lines)) if pattern.search(lines[j])), None)
        if found is None:
            missing.append(want)
        else:
            at = found + 1
    return missing
