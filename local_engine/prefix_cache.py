"""The prefix cache of an engine that runs SGLang's radix cache (no ``--disable-radix-cache``).

SGLang keeps the KV of a request that ends (``release_kv_cache(..., checkpoint=True)`` in every
release 0.5.15-0.5.23) in its radix tree; a later request whose context starts with the same
tokens (and the same LoRA adapter) takes that prefix's KV from the tree instead of computing
it, whatever the weights are now, until a cache flush. That is what makes a weight sync that
flushes nothing (``in_place``) reuse old-weight KV: a per_request call aborted by its exact rid
and resent after the sync (prompt + kept tokens) is prefilled over the KV the old weights
computed, and only its last token is computed anew (issue 66 N1).

What local_engine keeps (:class:`PrefixCache`): the KV of every request that was *running*
(it had a row) when an abort ended it — exact rid, prefix or ``abort_all`` — covering its
prompt and every output token but the last (the last one was sampled, never fed). A prefill of
a request that asks for no prompt log-probs then takes the longest common prefix with any entry
(at least :data:`MIN_MATCH` tokens, at most all but the last token of its context) from it.
Not kept here: requests that finish normally (SGLang caches them too; the sync agent refuses
``in_place`` on an engine whose cache is on either way) and the tree's sharing between entries.

Bounded by :data:`MAX_ENTRIES` and :data:`MAX_BYTES` (least recently used entries go first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

MAX_ENTRIES = 64
MAX_BYTES = 256 * 2**20
MIN_MATCH = 1

KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Entry:
    tokens: tuple[int, ...]
    kv: KV
    """Per layer ``(keys, values)`` of shape ``[1, heads, len(tokens), dim]``."""
    routes: torch.Tensor | None
    """Routed experts of those positions (``[len(tokens), layers, top_k]``), if recorded."""
    adapter: str | None

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)


@dataclass(frozen=True)
class Hit:
    length: int
    kv: KV
    routes: torch.Tensor | None


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Token prefixes → their KV, filled from aborted running requests (module docstring)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._next = 0
        self.inserted = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def insert(self, tokens: list[int], kv: KV, routes: torch.Tensor | None, adapter: str | None) -> None:
        """Keep ``kv`` (computed over ``tokens``) for later prefills."""
        if not tokens:
            return
        self._entries[self._next] = Entry(tuple(tokens), kv, routes, adapter)
        self._next += 1
        self.inserted += 1
        total = sum(e.nbytes for e in self._entries.values())
        while self._entries and (len(self._entries) > self.max_entries or total > self.max_bytes):
            _, gone = self._entries.popitem(last=False)
            total -= gone.nbytes

    def match(self, context: list[int], adapter: str | None, need_routes: bool) -> Hit | None:
        """The longest cached prefix of ``context`` (at most all but its last token), or None."""
        best, best_key = 0, None
        for key, entry in self._entries.items():
            if entry.adapter != adapter or (need_routes and entry.routes is None):
                continue
            n = min(_common(entry.tokens, context), len(context) - 1)
            if n > best:
                best, best_key = n, key
        if best_key is None or best < MIN_MATCH:
            return None
        self._entries.move_to_end(best_key)
        entry = self._entries[best_key]
        self.hits += 1
        return Hit(best, [(k[:, :, :best], v[:, :, :best]) for k, v in entry.kv],
                   None if entry.routes is None else entry.routes[:best])

    def clear(self) -> None:
        """A cache flush."""
        self._entries.clear()
