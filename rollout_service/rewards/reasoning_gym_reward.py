"""Scoring reasoning-gym problems with the task's own verifier.

The answer is the text of the response's last ``<answer>...</answer>`` (reasoning-gym's
``extract_answer``, the format its system prompt asks for); the problem is regenerated from
``extra_info`` (``split``, ``index``) with the run's settings (:mod:`rollout_service.data.
reasoning_gym_task`) and ``dataset.score_answer(answer, entry)`` gives the score in [0, 1]
(some tasks give partial credit). No answer tag scores 0.0 with ``details["answer"] = ""`` —
unless ``answer_fallback = "last_number"`` (``data.source_answer = "tag_or_last_number"``): then
a response without a tag is judged on its last number, for numeric tasks and models too small
to write tags (SmolLM2-135M never does; docs/data_and_rewards.md). ``details["answer_from"]``
says which: ``tag``, ``last_number`` or ``none``.
A row whose ``extra_info`` names no known split or index is a bad sample: the registry turns
the raised error into a failed reward (never trained).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_service.data.reasoning_gym_task import create, split_seeds
from rollout_service.rewards.base import RewardResult
from rollout_service.rewards.extract import last_number


class ReasoningGymReward:
    """A reward function for ``reasoning_gym/<name>`` (module docstring). Blocking: the
    registry runs it in a worker thread."""

    def __init__(self, name: str, options: Mapping[str, Any], size: int, val_size: int, seed: int,
                 answer_fallback: str | None = None) -> None:
        if answer_fallback not in (None, "last_number"):
            raise ValueError(f"answer_fallback must be None or 'last_number', got {answer_fallback!r}")
        seeds = split_seeds(seed)
        self.name = name
        self.answer_fallback = answer_fallback
        self.datasets = {"train": create(name, options, size, seeds["train"])}
        if val_size > 0:
            self.datasets["val"] = create(name, options, val_size, seeds["val"])

    def __call__(self, response_text: str, ground_truth: Any, extra_info: Mapping[str, Any]) -> RewardResult:
        from reasoning_gym.utils import extract_answer

        split, index = extra_info.get("split"), extra_info.get("index")
        ds = self.datasets.get(split)
        if ds is None or not isinstance(index, int) or not 0 <= index < len(ds):
            raise ValueError(f"reasoning_gym/{self.name}: extra_info {dict(extra_info)} names no generated problem")
        answer, source = extract_answer(response_text), "tag"
        if answer is None and self.answer_fallback == "last_number":
            answer, source = last_number(response_text), "last_number"
        if answer is None:
            return RewardResult(0.0, {"answer": "", "rg_score": 0.0, "answer_from": "none"})
        score = float(ds.score_answer(answer=answer, entry=ds[index]))
        return RewardResult(score, {"answer": answer[:200], "rg_score": score, "answer_from": source})
