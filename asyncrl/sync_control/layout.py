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

import re
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
    radix_cache: bool | None = None
    """The engine caches prefixes across requests (``disable_radix_cache`` false); None: not reported."""
    overlap_schedule: bool | None = None
    """The engine runs SGLang's overlap scheduler (``disable_overlap_schedule`` false); None: not reported."""
    ep_size: int = 1
    dtype: str | None = None
    quantization: str | None = None
    draft_model: str | None = None
    """``speculative_draft_model_path``: a draft model's weights are hashed with the target's."""

    @property
    def weights_kind(self) -> str:
        """What makes two engines' ``/weights_checker`` checksums comparable (issue 66 N9): the
        release, and whatever changes which tensors it hashes or how they are laid out or
        stored (expert parallelism, dtype, quantization, a draft model). The TP layout is
        compared separately (the number of ranks answering)."""
        parts = [f"sglang {self.version}"]
        if self.ep_size != 1:
            parts.append(f"ep_size {self.ep_size}")
        for name in ("dtype", "quantization", "draft_model"):
            value = getattr(self, name)
            if value not in (None, "auto"):
                parts.append(f"{name} {value}")
        return ", ".join(parts)

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
                   nccl_version=None if info.get("nccl_version") is None else str(info["nccl_version"]),
                   radix_cache=_on_unless(info, "disable_radix_cache"),
                   overlap_schedule=_on_unless(info, "disable_overlap_schedule"),
                   ep_size=info["ep_size"] if isinstance(info.get("ep_size"), int) and info["ep_size"] > 0 else 1,
                   dtype=_text(info.get("dtype")), quantization=_text(info.get("quantization")),
                   draft_model=_text(info.get("speculative_draft_model_path")))

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


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _on_unless(info: dict[str, Any], disable_key: str) -> bool | None:
    """A feature SGLang runs unless ``--<disable_key>``: True/False from ``/server_info``, None
    when the key is absent (not an SGLang-shaped engine: not judged)."""
    value = info.get(disable_key)
    return None if not isinstance(value, bool) else not value


MOE_POSTPROCESS_FROM = (0, 5, 21)
"""First sglang release whose weight-update session (``begin``/``end_weight_update``) runs the
model's post-load processing after a distributed update (``postprocess_weights``: what MoE
runners that repack their expert weights — flashinfer_trtllm's w13/w2 permutation, the CPU AMX
packing — and quantized layers need); before it, updated expert weights are served unprocessed."""
EXPERT_NAME = re.compile(r"\.experts\.")


def moe_problems(layouts: Sequence[EngineLayout], names: Sequence[str]) -> list[str]:
    """Why a full weight sync of these tensor ``names`` cannot run on these engines: expert
    weights (a mixture-of-experts model) on a release before :data:`MOE_POSTPROCESS_FROM`
    (issue 66 N5). Engines of an unknown release pass."""
    if not any(EXPERT_NAME.search(n) for n in names):
        return []
    out = []
    for layout in layouts:
        v = parse_version(layout.version)
        if v is not None and v < MOE_POSTPROCESS_FROM:
            out.append(f"engine {layout.engine} runs sglang {layout.version}, which has no weight-update session: its "
                       f"MoE runners would serve the updated expert weights without their post-load processing "
                       f"(repacking); run sglang >= {'.'.join(map(str, MOE_POSTPROCESS_FROM))} for MoE weight syncs")
    return out


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
