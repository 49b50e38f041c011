"""Supervised examples for the demo task, built with the same token bookkeeping the agents
use: the prompt from the chat template (with the tool schemas), the model's ideal first
turn (a calculator call), the environment segment with the calculator's real answer, and
the ideal final turn (``The answer is \\boxed{N}.``). Loss mask 1 on the two model turns.

With ``correct_fraction < 1`` some examples carry a wrong final answer (off by a small
amount) so a warmed-up model starts with a mediocre reward that RL can raise.
"""

from __future__ import annotations

import json
import random

from rollout_service.agent.chat import ChatTokenizer
from rollout_service.data.demo_task import ArithSpec, generate_rows
from tools.calculator import evaluate_expression, format_number


def tool_call_text(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"


def answer_text(value: str) -> str:
    return f"The answer is \\boxed{{{value}}}."


def demo_sft_examples(chat: ChatTokenizer, n: int, seed: int = 1, correct_fraction: float = 1.0,
                      spec: ArithSpec | None = None) -> list[tuple[list[int], list[int]]]:
    """``n`` (token_ids, loss_mask) pairs over demo-task prompts (see the module doc)."""
    rng = random.Random(seed)
    out = []
    for row in generate_rows(n, seed=seed, split="train", spec=spec):
        expr = row["extra_info"]["expression"]
        result = format_number(evaluate_expression(expr))
        prompt = chat.prompt_ids(row["prompt"])
        turn1 = chat.encode_text(tool_call_text(expr)) + [chat.eos_token_id]
        env = chat.environment_segment([{"role": "tool", "content": result}])
        final = result if rng.random() < correct_fraction else str(int(float(result)) + rng.choice([-10, -1, 1, 10]))
        turn2 = chat.encode_text(answer_text(final)) + [chat.eos_token_id]
        ids = prompt + turn1 + env + turn2
        mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
        out.append((ids, mask))
    return out
