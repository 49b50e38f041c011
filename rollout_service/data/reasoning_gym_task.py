"""reasoning-gym tasks as a dataset: ``data.source = "reasoning_gym:<name>"``.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (the optional extra
``asyncrl[reasoning-gym]``) generates verifiable problems procedurally. A run names one of its
datasets and that dataset's own generator settings (``data.source_options``: e.g.
``min_terms``, ``max_digits`` for ``basic_arithmetic``; the difficulty knobs, where the task
has them); the training split is ``data.source_size`` problems from seed ``data.seed``, the
validation split ``data.source_val_size`` problems from seed ``data.seed + 1``. Both are
written once, in verl's layout, to ``<run dir>/data/<name>-<fingerprint>/`` (the fingerprint
covers name, options, sizes and seed, so a changed setting never reuses old files):

- ``prompt``: reasoning-gym's default system prompt (think, then ``<answer>...</answer>``)
  and the question as the user turn;
- ``data_source``: ``reasoning_gym/<name>``, ``reward_model.ground_truth``: the reference
  answer (for reading only: scoring uses the task's own verifier, see
  :mod:`rollout_service.rewards.reasoning_gym_reward`);
- ``extra_info``: ``{"split", "index"}`` — the problem is regenerated from them at scoring
  time (procedural datasets are deterministic by seed and index), so nothing of the task's
  metadata has to survive JSON.

Not covered: reasoning-gym's composite datasets and curricula objects (use the options of
one dataset), and changing difficulty during a run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PREFIX = "reasoning_gym:"
DATA_SOURCE_PREFIX = "reasoning_gym/"
INSTALL_HINT = "pip install 'asyncrl[reasoning-gym]' (with the CPU torch constraint: -c constraints/cpu.txt)"


class TaskConfigError(ValueError):
    """A ``data.source`` that cannot be built: unknown dataset, bad options, package missing."""


def task_name(source: str) -> str:
    """``reasoning_gym:<name>`` -> ``<name>``; TaskConfigError for anything else."""
    if not source.startswith(PREFIX) or not source[len(PREFIX):].strip():
        raise TaskConfigError(f"data.source {source!r}: expected 'reasoning_gym:<dataset name>'")
    return source[len(PREFIX):].strip()


def create(name: str, options: Mapping[str, Any], size: int, seed: int):
    """reasoning-gym's dataset object; TaskConfigError naming the problem."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise TaskConfigError(f"data.source reasoning_gym:{name} needs the reasoning-gym package: {INSTALL_HINT}") from None
    if name not in DATASETS:
        close = sorted(n for n in DATASETS if name.split("_")[0] in n)[:8]
        raise TaskConfigError(f"reasoning-gym has no dataset {name!r}" + (f" (similar: {', '.join(close)})" if close else ""))
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **dict(options))
    except (TypeError, ValueError, AssertionError) as exc:
        raise TaskConfigError(f"reasoning-gym dataset {name!r} refused data.source_options {dict(options)}: "
                              f"{type(exc).__name__}: {exc}") from None


def split_seeds(seed: int) -> dict[str, int]:
    return {"train": seed, "val": seed + 1}


def system_prompt() -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def rows(name: str, options: Mapping[str, Any], size: int, seed: int, split: str) -> list[dict[str, Any]]:
    """The split's rows in verl's layout (module docstring)."""
    if size <= 0:
        return []
    ds = create(name, options, size, seed)
    system = system_prompt()
    out = []
    for i in range(size):
        entry = ds[i]
        out.append({
            "prompt": [{"role": "system", "content": system}, {"role": "user", "content": str(entry["question"])}],
            "data_source": DATA_SOURCE_PREFIX + name,
            "reward_model": {"ground_truth": str(entry["answer"])},
            "extra_info": {"split": split, "index": i},
        })
    return out


def fingerprint(name: str, options: Mapping[str, Any], size: int, val_size: int, seed: int) -> str:
    blob = json.dumps([name, dict(options), size, val_size, seed], sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def write_dataset(directory: str | Path, name: str, options: Mapping[str, Any], size: int, val_size: int,
                  seed: int) -> tuple[Path, Path]:
    """Write (once) ``train.jsonl`` and ``val.jsonl`` of the task under ``directory``; their paths."""
    root = Path(directory) / f"{name}-{fingerprint(name, options, size, val_size, seed)}"
    train, val = root / "train.jsonl", root / "val.jsonl"
    if train.is_file() and val.is_file():
        return train, val
    root.mkdir(parents=True, exist_ok=True)
    seeds = split_seeds(seed)
    for path, split, n in ((train, "train", size), (val, "val", val_size)):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows(name, options, n, seeds[split], split)))
        tmp.replace(path)
    return train, val
