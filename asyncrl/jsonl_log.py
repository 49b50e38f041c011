"""An append-only JSON-lines log on disk with a size bound: past ``max_bytes`` the file becomes
``<name>.1`` (replacing the previous one) and a new file starts, so the log takes at most twice
``max_bytes`` and always holds at least the last ``max_bytes`` of records. Each line is flushed
(not fsynced: a crash can lose the last lines, never corrupt earlier ones; :meth:`read` skips a
cut last line). A write that fails (disk full) is logged and dropped: a log never stops the
work it records.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class BoundedJsonl:
    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.previous = self.path.with_name(self.path.name + ".1")

    def append(self, record: dict[str, Any]) -> None:
        self.append_many([record])

    def append_many(self, records: list[dict[str, Any]]) -> None:
        """Append ``records`` with one open and one write (rotation is checked once, before)."""
        if not records:
            return
        text = "".join(json.dumps(record, default=str) + "\n" for record in records)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file() and self.path.stat().st_size + len(text) > self.max_bytes:
                os.replace(self.path, self.previous)
            with self.path.open("a") as f:
                f.write(text)
        except OSError as exc:
            log.warning("%s not written: %s", self.path, exc)

    def last(self) -> dict[str, Any] | None:
        """The newest record (the current file's last whole line; the rotated file's if it is empty)."""
        for p in (self.path, self.previous):
            if p.is_file():
                for line in reversed(p.read_bytes().splitlines()):
                    try:
                        return json.loads(line)
                    except ValueError:
                        continue
        return None

    def read(self) -> list[dict[str, Any]]:
        """Every record kept, oldest first (the rotated file, then the current one)."""
        out = []
        for p in (self.previous, self.path):
            if p.is_file():
                for line in p.read_text().splitlines():
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        continue  # a line cut by a crash
        return out
