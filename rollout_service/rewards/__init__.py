"""Reward functions for the rollout service: a registry keyed by ``data_source``, a math
answer checker on math-verify (in worker processes with a hard timeout), a format reward
and their weighted combination. See docs/data_and_rewards.md."""

from .base import AsyncRewardFn, RewardFn, RewardRegistry, RewardResult, score_async
from .defaults import ARITH_DATA_SOURCE, default_registry
from .extract import (
    BoxedAnswer,
    ToolCallCheck,
    check_tool_calls,
    count_boxes,
    last_boxed,
    last_number,
)
from .format_reward import CombinedReward, FormatConfig, FormatReward
from .math_pool import VerifyOutcome, VerifyPool
from .math_reward import MathReward, MathRewardConfig, gold_latex

__all__ = [
    "ARITH_DATA_SOURCE",
    "AsyncRewardFn",
    "BoxedAnswer",
    "CombinedReward",
    "FormatConfig",
    "FormatReward",
    "MathReward",
    "MathRewardConfig",
    "RewardFn",
    "RewardRegistry",
    "RewardResult",
    "ToolCallCheck",
    "VerifyOutcome",
    "VerifyPool",
    "check_tool_calls",
    "count_boxes",
    "default_registry",
    "gold_latex",
    "last_boxed",
    "last_number",
    "score_async",
]
