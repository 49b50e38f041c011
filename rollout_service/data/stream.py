"""The training prompt stream: epochs, deterministic per-epoch shuffling, verl's
``total_rollout_steps`` limit, and exact resumability.

Order: epoch ``e`` visits every record once, in file/row order when ``shuffle`` is False,
else in the permutation ``random.Random(seed * 2**32 + e).shuffle(range(n))`` (stable across
processes and Python runs; Python's ``random`` algorithm for int seeds is fixed).

Length: ``total = n * total_epochs``, capped at ``total_rollout_steps`` when given (verl:
``min(total_rollout_steps, len(dataloader) * total_epochs)``, one prompt per dataloader step
since the fully async rollouter uses ``gen_batch_size=1``). One produced prompt is one
*sample*: the rollout service expands it into ``rollout.n`` trajectories.

Resumability: :meth:`PromptStream.state_dict` is a small JSON-able dict (epoch, position,
produced, seed, shuffle, dataset fingerprint). A fresh stream over the same records that
loads it yields exactly the prompts an uninterrupted stream would have yielded next. The
state counts prompts *handed out*: a caller that wants at-least-once processing must also
checkpoint the prompts still in flight. Loading a state taken over a different record list
(other files, other length filter) raises ``ValueError`` unless ``strict=False``.

Memory: all records are held in memory (see :mod:`.reader`); the per-epoch permutation
is ``n`` ints. The length filter calls ``prompt_length_fn`` once per record at construction.
Thread-safe: ``next``/``state_dict``/``load_state_dict`` take a lock.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .reader import OnError, ReadStats, load_records
from .records import PromptRecord

logger = logging.getLogger(__name__)

STATE_VERSION = 1


def dataset_fingerprint(records: Sequence[PromptRecord]) -> str:
    """A short hash of the record count and the ordered (prompt_id, file, line) triples."""
    h = hashlib.sha256(str(len(records)).encode())
    for r in records:
        h.update(f"\n{r.prompt_id}\t{r.source_file}\t{r.source_line}".encode())
    return h.hexdigest()[:16]


class PromptStream:
    """An iterator of :class:`PromptRecord` (see the module doc for order and limits).

    ``prompt_length_fn`` with ``max_prompt_length``: records whose length exceeds the limit
    are dropped at construction and reported through ``on_skip(record, length)`` (default:
    a warning for the first 20) and counted in :attr:`skipped_too_long`.
    Raises ``ValueError`` when no record remains.
    """

    def __init__(
        self,
        records: Sequence[PromptRecord],
        *,
        total_epochs: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        total_rollout_steps: int | None = None,
        prompt_length_fn: Callable[[PromptRecord], int] | None = None,
        max_prompt_length: int | None = None,
        on_skip: Callable[[PromptRecord, int], None] | None = None,
    ) -> None:
        if total_epochs < 1:
            raise ValueError(f"total_epochs must be >= 1, got {total_epochs}")
        if total_rollout_steps is not None and total_rollout_steps < 1:
            raise ValueError(f"total_rollout_steps must be >= 1 or None, got {total_rollout_steps}")
        self.skipped_too_long = 0
        self.read_stats: ReadStats | None = None  # set by from_files
        kept = list(records)
        if prompt_length_fn is not None and max_prompt_length is not None:
            kept = self._filter_long(kept, prompt_length_fn, max_prompt_length, on_skip)
        if not kept:
            raise ValueError("the prompt stream has no records (all files empty, malformed or too long)")
        self._records = kept
        self._fingerprint = dataset_fingerprint(kept)
        self.shuffle = shuffle
        self.seed = seed
        n = len(kept)
        self.total = n * total_epochs if total_rollout_steps is None else min(total_rollout_steps, n * total_epochs)
        self._epoch = 0
        self._position = 0
        self._produced = 0
        self._order: list[int] | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_files(
        cls,
        files: str | Path | Iterable[str | Path],
        *,
        on_error: OnError | None = None,
        require_ground_truth: bool = True,
        **kwargs: Any,
    ) -> PromptStream:
        """Load ``files`` (see :func:`.reader.load_records`) and build a stream over them."""
        records, stats = load_records(files, on_error=on_error, require_ground_truth=require_ground_truth)
        stream = cls(records, **kwargs)
        stream.read_stats = stats
        return stream

    def _filter_long(self, records, length_fn, limit, on_skip) -> list[PromptRecord]:
        kept = []
        for rec in records:
            length = int(length_fn(rec))
            if length > limit:
                self.skipped_too_long += 1
                if on_skip is not None:
                    on_skip(rec, length)
                elif self.skipped_too_long <= 20:
                    logger.warning("skipping prompt %s (%s:%d): %d tokens > max_prompt_length %d",
                                   rec.prompt_id, rec.source_file, rec.source_line, length, limit)
                continue
            kept.append(rec)
        return kept

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._records)))
        if self.shuffle:
            random.Random(self.seed * 2**32 + epoch).shuffle(order)
        return order

    # -- iteration -----------------------------------------------------------------------

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> PromptRecord:
        with self._lock:
            if self._produced >= self.total:
                raise StopIteration
            if self._position >= len(self._records):
                self._epoch += 1
                self._position = 0
                self._order = None
            if self._order is None:
                self._order = self._epoch_order(self._epoch)
            rec = self._records[self._order[self._position]]
            self._position += 1
            self._produced += 1
            return rec

    def __len__(self) -> int:
        """Total prompts this stream produces from the start (not the remaining count)."""
        return self.total

    @property
    def num_records(self) -> int:
        return len(self._records)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def produced(self) -> int:
        return self._produced

    @property
    def remaining(self) -> int:
        return max(0, self.total - self._produced)

    @property
    def exhausted(self) -> bool:
        return self._produced >= self.total

    # -- checkpointing -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The resume point, a JSON-able dict (see the module doc)."""
        with self._lock:
            return {
                "version": STATE_VERSION,
                "epoch": self._epoch,
                "position": self._position,
                "produced": self._produced,
                "seed": self.seed,
                "shuffle": self.shuffle,
                "num_records": len(self._records),
                "fingerprint": self._fingerprint,
            }

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Continue from ``state``. Seed and shuffle come from the state (the order must not
        change mid-run); ``total_epochs``/``total_rollout_steps`` stay as constructed, so a
        run can be extended. ``strict``: refuse a state taken over other records."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported prompt stream state version {state.get('version')!r}")
        epoch, position, produced = int(state["epoch"]), int(state["position"]), int(state["produced"])
        n = len(self._records)
        if strict and (state.get("num_records") != n or state.get("fingerprint") != self._fingerprint):
            raise ValueError(
                f"prompt stream state was taken over other records (num_records {state.get('num_records')} "
                f"vs {n}, fingerprint {state.get('fingerprint')} vs {self._fingerprint})"
            )
        if epoch < 0 or produced < 0 or not 0 <= position <= n:
            raise ValueError(f"invalid prompt stream state: epoch={epoch} position={position} produced={produced}")
        with self._lock:
            self.seed = int(state["seed"])
            self.shuffle = bool(state["shuffle"])
            self._epoch, self._position, self._produced = epoch, position, produced
            self._order = None
