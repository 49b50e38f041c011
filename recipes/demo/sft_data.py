"""Supervised examples for the demo task, built with the same token bookkeeping the agents
use: the prompt from the chat template (with the tool schemas), the model's ideal first
turn (a tool call with the question's expression), the environment segment with that
tool's real answer, and the final turn copying it (``The answer is \\boxed{N}.``). Loss mask
1 on the two model turns.

With ``exact_fraction < 1`` the other examples call ``estimate`` (rounded, usually wrong)
instead of the exact ``calculator`` and box its result: a policy warmed up on them starts
with a low reward and one clear thing to learn (choose the exact tool). The chat tokenizer
must carry the schemas of every tool the examples call.

Used by the trainer's warm-ups (``recipes.demo.warmup``); no torch here.
"""

from __future__ import annotations

import json
import random

from asyncrl.chat import ChatTokenizer
from recipes.demo.task import ArithSpec, generate_rows
from tools.calculator import evaluate_expression, format_number
from tools.estimate import estimate_value


def tool_call_text(tool: str, expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": {"expression": expression}}) + "\n</tool_call>"


def answer_text(value: str) -> str:
    return f"The answer is \\boxed{{{value}}}."


def demo_sft_examples(chat: ChatTokenizer, n: int, seed: int = 1, exact_fraction: float = 1.0,
                      spec: ArithSpec | None = None) -> list[tuple[list[int], list[int]]]:
    """``n`` (token_ids, loss_mask) pairs over demo-task prompts of ``spec`` (see the module
    doc); deterministic in every argument."""
    rng = random.Random(seed)
    out = []
    for row in generate_rows(n, seed=seed, split="train", spec=spec):
        expr = row["extra_info"]["expression"]
        tool = "calculator" if rng.random() < exact_fraction else "estimate"
        result = format_number(evaluate_expression(expr) if tool == "calculator" else estimate_value(expr))
        prompt = chat.prompt_ids(row["prompt"])
        turn1 = chat.encode_text(tool_call_text(tool, expr)) + [chat.eos_token_id]
        env = chat.environment_segment([{"role": "tool", "content": result}])
        turn2 = chat.encode_text(answer_text(result)) + [chat.eos_token_id]
        ids = prompt + turn1 + env + turn2
        mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
        out.append((ids, mask))
    return out
