"""The reward table the rollout service starts from.

``asyncrl/arith`` (the built-in demo task) is scored by the math checker alone: 1.0 when the
last ``\\boxed{}`` equals the integer ground truth, else 0.0 (no format bonus, so the
reward is exactly task success). With ``format_weight > 0`` it becomes a
:class:`~.format_reward.CombinedReward` that also checks the tool calls' format. Every
other data source goes to the math checker as well when ``math_default`` is True (verl's
math sets use the same ``\\boxed{}`` convention), else it is a ``LookupError``.
"""

from __future__ import annotations

from .base import RewardRegistry
from .format_reward import CombinedReward, FormatConfig, FormatReward
from .math_reward import MathReward

ARITH_DATA_SOURCE = "asyncrl/arith"


def default_registry(math: MathReward, *, format_weight: float = 0.0, math_default: bool = True) -> RewardRegistry:
    """A fresh registry using ``math`` (the caller owns and closes it)."""
    registry = RewardRegistry(default=math if math_default else None)
    if format_weight > 0:
        fmt = FormatReward(FormatConfig(require_single_box=True, check_tool_calls=True, min_tool_calls=1))
        registry.register(ARITH_DATA_SOURCE, CombinedReward(math, fmt, format_weight=format_weight))
    else:
        registry.register(ARITH_DATA_SOURCE, math)
    return registry
