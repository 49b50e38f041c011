"""The routed experts of a trajectory (issue 53): for a mixture-of-experts policy, which experts
each position of ``token_ids`` was routed to when the engine computed it, so the trainer can
replay them (``actor.router_replay.mode = "R3"``).

Layout: ``rows`` holds ``len(token_ids) - 1`` rows (position ``j`` is the routing when token
``j`` was the model's input; the last token never was), each ``layers × top_k`` expert ids,
C-order, little-endian unsigned integers of ``width`` bytes (1 below 255 experts, else 2):
at most ``layers × top_k`` bytes per token with 1-byte ids. A layer without experts (a dense
MLP) has zero rows. The largest id of the width (:func:`no_route`: 255 or 65535) means *no
route*: positions no engine call reported (environment tokens after the last call; the tokens
of a stream broken before its routes came) are such rows, and the trainer routes them live.

Each row comes from the generate call that first computed its position (the engine's
``routed_experts_start_len``), not from the last call: after an abort and resume, the tokens
decoded before the sync keep the routes of the weights that sampled them.

Invariants (checked on construction and decode, with the trajectory's length): ``layers`` and
``top_k`` are at least 1, ``width`` is 1 or 2, ``rows`` holds exactly ``(len(token_ids) - 1) ×
layers × top_k × width`` bytes. The expert ids' range is the model's, checked by the trainer.
"""

from __future__ import annotations

import base64

import msgspec
import numpy as np

MAX_LAYERS = 1024
MAX_TOP_K = 64


class RoutedExperts(msgspec.Struct, kw_only=True, frozen=True):
    """Expert ids per position (module docstring)."""

    layers: int
    top_k: int
    width: int = 1
    rows: bytes = b""

    @property
    def dtype(self) -> str:
        return "<u1" if self.width == 1 else "<u2"

    @property
    def row_bytes(self) -> int:
        return self.layers * self.top_k * self.width

    @property
    def num_rows(self) -> int:
        return len(self.rows) // self.row_bytes if self.row_bytes else 0

    def array(self) -> np.ndarray:
        """The ids as ``[rows, layers, top_k]`` int64."""
        return np.frombuffer(self.rows, dtype=self.dtype).reshape(-1, self.layers, self.top_k).astype(np.int64)

    def errors(self, positions: int) -> list[str]:
        """Why this does not fit a trajectory of ``positions + 1`` tokens ([] when it does)."""
        if not (1 <= self.layers <= MAX_LAYERS and 1 <= self.top_k <= MAX_TOP_K) or self.width not in (1, 2):
            return [f"routed_experts: layers {self.layers}, top_k {self.top_k}, width {self.width} out of range "
                    f"(layers 1-{MAX_LAYERS}, top_k 1-{MAX_TOP_K}, width 1 or 2)"]
        want = positions * self.row_bytes
        if len(self.rows) != want:
            return [f"routed_experts holds {len(self.rows)} bytes; {positions} positions x {self.layers} layers x "
                    f"{self.top_k} experts x {self.width} bytes need {want}"]
        return []


def width_for(num_experts: int) -> int:
    """Bytes per expert id for a model with ``num_experts`` routed experts (the largest value
    of the width stays free: :func:`no_route`)."""
    if num_experts > 65535:
        raise ValueError(f"{num_experts} experts do not fit the wire's 2-byte expert ids")
    return 1 if num_experts <= 255 else 2


def no_route(width: int) -> int:
    """The id that marks a row the engine did not report (module docstring)."""
    return 256**width - 1


def engine_rows(text: str, layers: int, top_k: int) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` (base64 of little-endian int32, no header) as
    ``[rows, layers, top_k]`` int64; ValueError when it does not divide into such rows."""
    flat = np.frombuffer(base64.b64decode(text, validate=True), dtype="<i4")
    if flat.size % (layers * top_k):
        raise ValueError(f"routed_experts holds {flat.size} ids, not a multiple of layers x top_k = {layers} x {top_k}")
    return flat.astype(np.int64).reshape(-1, layers, top_k)


def pack_rows(rows: np.ndarray, width: int) -> bytes:
    """``[rows, layers, top_k]`` ids as the wire's bytes; ValueError for an id the width cannot
    hold (its largest value is :func:`no_route`)."""
    if rows.size and (rows.min() < 0 or rows.max() >= no_route(width)):
        raise ValueError(f"expert ids must be in [0, {no_route(width)}), got [{rows.min()}, {rows.max()}]")
    return rows.astype("<u1" if width == 1 else "<u2").tobytes()
