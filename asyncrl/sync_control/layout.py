"""What an engine's ``/server_info`` says about its ranks, and whether SGLang can update it.

SGLang's weight updater joins the group once per tensor-parallel worker, as rank
``rank_offset + tp_rank``; it ignores pipeline stages and data-parallel replicas. So an engine
takes ``tp_size`` ranks, engine *i* gets ``rank_offset = 1 + Σ tp_size of the engines before
it``, and the group's world size is ``1 + Σ tp_size``. Layouts SGLang cannot update (checked
against its source, see docs/sync_agent.md):

- ``pp_size > 1``: every stage would join as the same ranks;
- ``dp_size > 1``: refused by SGLang 0.5.22 and later (``assert dp_size == 1``); 0.5.21 and
  older accept it only with ``enable_dp_attention`` (the replicas are then the TP workers).

NCCL: two processes can form a communicator only with the same NCCL version. SGLang does not
report its NCCL; each sglang release pins an exact torch (which pins NCCL), so an engine's
torch is known from its version (:data:`SGLANG_TORCH_PINS`). An engine that reports
``nccl_version`` itself (local_engine on CUDA) is compared directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.engine_client.release import parse_version  # the one parser (re-exported here)

SGLANG_TORCH_PINS = ({(0, 5, n): "2.11.0" for n in range(15, 18)} | {(0, 5, n): "2.13.0" for n in range(18, 22)}
                     | {(0, 5, 22): "2.14.1", (0, 5, 23): "2.14.1"})
"""``Requires-Dist: torch==`` of each sglang wheel, read from the wheels' METADATA
(tests/contract/test_release_facts.py checks every supported release against its wheel)."""
DP_STRICT_FROM = (0, 5, 22)
"""First sglang version that asserts ``dp_size == 1`` on every weight-update route."""


class LayoutError(ValueError):
    """An engine's layout cannot be updated over a weight-update group; names engine and setting."""


@dataclass(frozen=True)
class EngineLayout:
    """The parallel layout of one engine (``engine``: its id or URL, for messages)."""

    engine: str
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    enable_dp_attention: bool = False
    version: str | None = None
    nccl_version: str | None = None
    """Reported by the engine (local_engine on CUDA); SGLang reports none."""

    @classmethod
    def from_server_info(cls, engine: str, info: dict[str, Any]) -> EngineLayout:
        def size(key: str) -> int:
            value = info.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"engine {engine}: /server_info {key}={value!r} is not a positive integer")
            return value

        return cls(engine=engine, tp_size=size("tp_size"), dp_size=size("dp_size"), pp_size=size("pp_size"),
                   enable_dp_attention=bool(info.get("enable_dp_attention", False)),
                   version=None if info.get("version") is None else str(info["version"]),
                   nccl_version=None if info.get("nccl_version") is None else str(info["nccl_version"]))

    @property
    def ranks(self) -> int:
        """Ranks this engine takes in the weight-update group."""
        return self.tp_size

    def check(self) -> None:
        """Raise :class:`LayoutError` for a layout SGLang cannot update (module docstring)."""
        if self.pp_size > 1:
            raise LayoutError(f"engine {self.engine}: pp_size={self.pp_size}; SGLang's weight update joins the group as "
                              "rank_offset + tp_rank and ignores pipeline stages: launch it with --pp-size 1")
        if self.dp_size > 1:
            v = parse_version(self.version)
            strict = v is None or v >= DP_STRICT_FROM
            if strict or not self.enable_dp_attention:
                release = f"sglang {self.version}" if v else f"sglang {self.version!r} (unknown version), like 0.5.22+,"
                why = (f"{release} asserts dp_size == 1 for weight updates" if strict
                       else "without --enable-dp-attention the data-parallel replicas are not in the group")
                raise LayoutError(f"engine {self.engine}: dp_size={self.dp_size}; {why}: run one engine per replica "
                                  "(--dp-size 1) instead")

    def torch_pin(self) -> str | None:
        """The torch this engine's sglang release pins, when known."""
        v = parse_version(self.version)
        return SGLANG_TORCH_PINS.get(v) if v else None


def assign_ranks(layouts: Sequence[EngineLayout]) -> tuple[list[int], int]:
    """Check every layout; return each engine's ``rank_offset`` and the world size."""
    offsets, next_rank = [], 1
    for layout in layouts:
        layout.check()
        offsets.append(next_rank)
        next_rank += layout.ranks
    return offsets, next_rank


def check_nccl(layouts: Sequence[EngineLayout], trainer_nccl: str | None, trainer_torch: str | None) -> list[str]:
    """Messages naming every engine whose NCCL cannot match the trainer's (empty: all fine or
    nothing to compare). Compared: a reported ``nccl_version``; else the torch the engine's
    sglang pins against the trainer's torch (same torch build ⇒ same NCCL)."""
    problems = []
    base_torch = (trainer_torch or "").split("+")[0] or None
    for layout in layouts:
        if layout.nccl_version and trainer_nccl:
            if layout.nccl_version != trainer_nccl:
                problems.append(f"engine {layout.engine} runs NCCL {layout.nccl_version}, the trainer NCCL {trainer_nccl}")
            continue
        pin = layout.torch_pin()
        if pin and base_torch and pin != base_torch:
            problems.append(f"engine {layout.engine} runs sglang {layout.version}, which pins torch {pin} (and its NCCL); "
                            f"the trainer runs torch {trainer_torch}{f' with NCCL {trainer_nccl}' if trainer_nccl else ''}: "
                            f"build the trainer image with torch=={pin}")
    return problems
