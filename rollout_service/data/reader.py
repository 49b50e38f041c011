"""Read prompt files in verl's layout: JSONL (``.jsonl``) or Parquet (``.parquet``).

Contracts:

- :func:`check_files` runs before anything is read: a missing path, a directory or an
  unsupported extension raises :class:`DataFileError` naming the file. An unreadable Parquet
  file (corrupt footer) also raises :class:`DataFileError`, when it is opened.
- A malformed row never stops reading: it is reported once through ``on_error`` as a
  :class:`~rollout_service.data.records.RowError` (file, 1-based line for JSONL or 0-based
  row for Parquet, kind, message), counted in :class:`ReadStats`, and skipped. Blank JSONL
  lines are ignored silently.
- Files are read in the order given, rows in file order. Nothing is evaluated.

Memory: :func:`iter_records` streams (one Parquet batch of ``batch_size`` rows at a time);
:func:`load_records` and :func:`read_validation_set` hold every record in memory, which is
meant for datasets up to a few hundred thousand short prompts (roughly 1-2 KB of Python
objects per record).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .records import PromptRecord, RowError, RowValidationError, record_from_row

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = {".jsonl": "line", ".parquet": "row"}

OnError = Callable[[RowError], None]


class DataFileError(ValueError):
    """A data file cannot be used at all (missing, unsupported extension, unreadable)."""


@dataclass
class ReadStats:
    """Counters of one read: rows seen (blank lines excluded), records kept, rows skipped
    as malformed (total and per kind), and prompt ids seen more than once."""

    rows: int = 0
    records: int = 0
    malformed: int = 0
    malformed_by_kind: Counter = field(default_factory=Counter)
    duplicate_ids: int = 0


def check_files(files: str | Path | Iterable[str | Path]) -> list[Path]:
    """Validate paths up front; return them as :class:`Path` in the given order."""
    if isinstance(files, (str, Path)):
        files = [files]
    paths = [Path(f) for f in files]
    if not paths:
        raise DataFileError("no data files given")
    for p in paths:
        if p.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise DataFileError(
                f"{p}: unsupported extension {p.suffix!r}; expected one of {sorted(SUPPORTED_SUFFIXES)}"
            )
        if not p.exists():
            raise DataFileError(f"{p}: file not found")
        if not p.is_file():
            raise DataFileError(f"{p}: not a regular file")
    return paths


def logging_reporter(max_logged: int = 20) -> OnError:
    """An ``on_error`` callback that logs the first ``max_logged`` errors as warnings and
    then one notice that further errors are only counted. State lives in the closure."""
    seen = 0

    def report(err: RowError) -> None:
        nonlocal seen
        seen += 1
        if seen <= max_logged:
            logger.warning("skipping malformed row: %s", err)
        elif seen == max_logged + 1:
            logger.warning("more malformed rows; further ones are counted, not logged")

    return report


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (1-based line, decoded object or RowValidationError) for non-blank lines."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                yield lineno, json.loads(raw)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
                yield lineno, RowValidationError("bad_json", f"invalid JSON: {str(exc)[:200]}")


def _iter_parquet(path: Path, batch_size: int) -> Iterator[tuple[int, Any]]:
    """Yield (0-based row index, row dict) batch by batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        batches = pf.iter_batches(batch_size=batch_size)
        row = 0
        for batch in batches:
            for item in batch.to_pylist():
                yield row, item
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise DataFileError(f"{path}: cannot read Parquet: {exc}") from exc


def iter_records(
    files: str | Path | Iterable[str | Path],
    *,
    on_error: OnError | None = None,
    stats: ReadStats | None = None,
    require_ground_truth: bool = True,
    batch_size: int = 1024,
) -> Iterator[PromptRecord]:
    """Stream valid records from ``files``; see the module doc for error handling.

    The paths are checked eagerly (on this call, not on the first ``next``).
    ``on_error`` defaults to :func:`logging_reporter`; pass ``stats`` to get counters.
    """
    paths = check_files(files)
    report = on_error if on_error is not None else logging_reporter()
    stats = stats if stats is not None else ReadStats()
    return _records(paths, report, stats, require_ground_truth, batch_size)


def _records(
    paths: list[Path], report: OnError, stats: ReadStats, require_ground_truth: bool, batch_size: int
) -> Iterator[PromptRecord]:
    seen_ids: set[str] = set()
    for path in paths:
        unit = SUPPORTED_SUFFIXES[path.suffix.lower()]
        rows = _iter_jsonl(path) if unit == "line" else _iter_parquet(path, batch_size)
        for line, row in rows:
            stats.rows += 1
            try:
                if isinstance(row, RowValidationError):
                    raise row
                rec = record_from_row(
                    row, file_stem=path.stem, source_file=str(path), line=line,
                    require_ground_truth=require_ground_truth,
                )
            except RowValidationError as exc:
                stats.malformed += 1
                stats.malformed_by_kind[exc.kind] += 1
                report(RowError(file=str(path), line=line, unit=unit, kind=exc.kind, message=str(exc)))
                continue
            if rec.prompt_id in seen_ids:
                stats.duplicate_ids += 1
            seen_ids.add(rec.prompt_id)
            stats.records += 1
            yield rec
    if stats.duplicate_ids:
        logger.warning("%d records share a prompt_id with an earlier record", stats.duplicate_ids)


def load_records(
    files: str | Path | Iterable[str | Path], **kwargs: Any
) -> tuple[list[PromptRecord], ReadStats]:
    """All valid records of ``files`` in file/row order, and the read counters.

    Keyword arguments are those of :func:`iter_records` (except ``stats``)."""
    stats = ReadStats()
    records = list(iter_records(files, stats=stats, **kwargs))
    return records, stats


def read_validation_set(
    files: str | Path | Sequence[str | Path], *, max_samples: int | None = None, **kwargs: Any
) -> list[PromptRecord]:
    """The validation set: same layout, file/row order, no shuffling, one pass.

    ``max_samples`` keeps only the first N valid records. Raises :class:`DataFileError` as
    :func:`check_files`, and when no valid record remains."""
    paths = check_files(files)
    out: list[PromptRecord] = []
    for rec in iter_records(paths, **kwargs):
        if max_samples is not None and len(out) >= max_samples:
            break
        out.append(rec)
    if not out:
        raise DataFileError(f"no valid records in validation files {[str(p) for p in paths]}")
    return out
