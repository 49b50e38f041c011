"""``builtin:tiny-arith``: builtin:tiny after a short supervised warm-up on the demo task.

The warm-up teaches the *format* of the demo task — call a tool with the question's
expression, then answer with the tool's result in ``\\boxed{}`` — with a deliberately bad
habit: most examples call ``estimate`` (rounded, usually wrong) and a minority call
``calculator`` (exact). The warmed-up policy therefore starts with a low reward, and the
RL run has one clear thing to learn: choose the exact tool. Built once (about two minutes
on two CPU cores) and cached under ``$ASYNCRL_CACHE_DIR/models/`` keyed by the code and the
recipe; imported lazily by ``asyncrl up`` / ``asyncrl warmup`` only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path

log = logging.getLogger(__name__)

SPEC = "builtin:tiny-arith"
# Measured on 2 CPU cores (builtin:tiny, batch 32, lr 1e-3): copying the question's operands
# into the call is learnt by ~400 steps (100 % exact), copying the tool's result into the box
# by ~600 (97 %); lr 3e-3 learnt neither in 1,200 steps, and operands of varying width much
# more slowly — hence level 0 (fixed width). About 5 minutes, once.
DEMO_LEVEL = 0
EXACT_FRACTION = 0.2  # share of warm-up examples that call the exact calculator: the start reward
STEPS = 550
BATCH = 32
LR = 1e-3
EXAMPLES = 4000
TOOLS = ("calculator", "estimate")


def _recipe_key() -> str:
    import asyncrl.models.builtin as builtin
    import rollout_service.agent.chat as chat
    import trainer_daemon.sft as sft

    h = hashlib.sha256()
    for mod in (builtin, chat, sft):
        h.update(Path(mod.__file__).read_bytes())
    h.update(Path(builtin._TOKENIZER_JSON).read_bytes() + Path(builtin._CHAT_TEMPLATE).read_bytes())
    h.update(json.dumps([DEMO_LEVEL, EXACT_FRACTION, STEPS, BATCH, LR, EXAMPLES, TOOLS]).encode())
    return h.hexdigest()[:12]


def examples(chat, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    from rollout_service.data.demo_task import ArithSpec, generate_rows
    from tools.calculator import evaluate_expression, format_number
    from tools.estimate import estimate_value

    rng = random.Random(seed)
    out = []
    for row in generate_rows(n, seed=seed, split="train", spec=ArithSpec.level(DEMO_LEVEL)):
        expr = row["extra_info"]["expression"]
        tool = "calculator" if rng.random() < EXACT_FRACTION else "estimate"
        result = format_number(evaluate_expression(expr) if tool == "calculator" else estimate_value(expr))
        prompt = chat.prompt_ids(row["prompt"])
        call = chat.encode_text("<tool_call>\n" + json.dumps({"name": tool, "arguments": {"expression": expr}}) + "\n</tool_call>")
        turn1 = call + [chat.eos_token_id]
        env = chat.environment_segment([{"role": "tool", "content": result}])
        turn2 = chat.encode_text(f"The answer is \\boxed{{{result}}}.") + [chat.eos_token_id]
        out.append((prompt + turn1 + env + turn2, [0] * len(prompt) + [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)))
    return out


def ensure_warm_model(progress=print) -> Path:
    """The warmed-up model directory (built and cached on first use)."""
    from asyncrl.models.cache import build_once
    from asyncrl.models.smollm2 import cache_dir

    def build(out: Path) -> None:
        import torch

        from asyncrl.models import load_model, load_tokenizer
        from rollout_service.agent.chat import ChatTokenizer
        from tools.registry import ToolRegistry
        from trainer_daemon.sft import SftConfig, save_hf, sft

        progress(f"warming up builtin:tiny on the demo task ({STEPS} SFT steps, cached afterwards) ...")
        torch.manual_seed(0)
        tok = load_tokenizer("builtin:tiny")
        model = load_model("builtin:tiny")
        chat = ChatTokenizer(tok, ToolRegistry.from_names(list(TOOLS)).schemas())
        losses = sft(model, examples(chat, EXAMPLES, seed=1), SftConfig(steps=STEPS, batch_size=BATCH, lr=LR, log_every=100), tok.pad_token_id)
        save_hf(model, tok, out)
        progress(f"warm-up done (final loss {sum(losses[-20:]) / 20:.3f}): {out}")

    return build_once(cache_dir() / "models" / f"tiny-arith-{_recipe_key()}", build)
