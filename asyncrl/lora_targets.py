"""Which modules a LoRA adapter targets, in SGLang's terms, and whether an engine can serve it.

SGLang groups an adapter's target modules before comparing them with the engine's
``--lora-target-modules`` (``sglang/srt/lora/utils.py: get_normalized_target_modules``, the
same in 0.5.15-0.5.23): ``q_proj``/``k_proj``/``v_proj`` are one ``qkv_proj``,
``gate_proj``/``up_proj`` one ``gate_up_proj``, a dotted name counts by its last part, and
peft's ``"all-linear"`` (or ``"all"``) is the sentinel ``{"all"}``. An engine accepts an
adapter when its rank is at most ``--max-lora-rank`` and its grouped targets are a subset of
the engine's (or either side is ``all``); otherwise ``/load_lora_adapter`` answers "... is
incompatible with the current LoRA memory pool configuration" (``mem_pool.can_support``).

:func:`serving_problem` makes that check before a run starts (issue 36: refused at start,
naming the setting, not at the first sync); local_engine uses the same functions, so it
accepts exactly what SGLang accepts.
"""

from __future__ import annotations

from collections.abc import Iterable

ALL = "all"
GROUPS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}
"""SGLang's grouping of the module names this project's models have (its table has more:
embeddings, the output layer, MLA and indexer projections, none of which asyncrl adapts)."""
LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The per-layer linear modules of the Llama/Qwen2 family: what ``all-linear`` covers here."""


def normalized_targets(targets: str | Iterable[str] | None) -> set[str]:
    """``targets`` grouped as SGLang groups them (module docstring); empty for None."""
    if targets is None:
        return set()
    if isinstance(targets, str):
        if targets not in (ALL, "all-linear"):
            raise ValueError(f"only 'all' or 'all-linear' can be a single string of target modules, got {targets!r}")
        return {ALL}
    out = set()
    for name in targets:
        leaf = name.split(".")[-1]
        out.add(ALL if leaf in (ALL, "all-linear") else GROUPS.get(leaf, leaf))
    return out


def covers(engine_targets: set[str], adapter_targets: set[str]) -> bool:
    """Whether an engine serving ``engine_targets`` (normalized) can hold an adapter on
    ``adapter_targets`` (normalized): SGLang's subset test, ``all`` on either side passing."""
    return ALL in engine_targets or ALL in adapter_targets or adapter_targets <= engine_targets


def serving_problem(rank: int, targets: str | Iterable[str], max_lora_rank: int | None,
                    engine_targets: str | Iterable[str] | None, where: str) -> str | None:
    """Why an engine (``where``: how to name it) with ``--max-lora-rank max_lora_rank`` and
    ``--lora-target-modules engine_targets`` cannot load a rank-``rank`` adapter on
    ``targets``; None when it can. ``max_lora_rank``/``engine_targets`` None: the engine has
    LoRA off (it then refuses every adapter)."""
    if max_lora_rank is None or engine_targets is None:
        return f"{where} does not serve LoRA adapters (start it with --enable-lora, --max-lora-rank and --lora-target-modules)"
    if rank > max_lora_rank:
        return (f"actor.lora_rank={rank} is over {where}'s --max-lora-rank {max_lora_rank}: "
                f"lower actor.lora_rank or start the engine with --max-lora-rank {rank}")
    have = normalized_targets(engine_targets)
    # peft resolves "all-linear" to the model's linear layers: the trainer's adapter names them
    want = normalized_targets(LINEAR_LEAVES if isinstance(targets, str) else targets)
    if not covers(have, want):
        return (f"actor.target_modules={targets!r} needs {sorted(want - have)} which {where} does not serve "
                f"(--lora-target-modules {' '.join(sorted(have))}): narrow actor.target_modules or widen the engine's flag")
    return None
