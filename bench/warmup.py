"""The demo's warm-up: how long it takes and what it teaches, for recipes side by side.

    .venv/bin/python bench/warmup.py [--recipes baseline,demo] [--eval 96]

Each recipe is trained from scratch here (not taken from the cache: the point is the time),
with the same code :mod:`recipes.demo.warmup` runs, then evaluated greedily on held-out demo
questions (level 0, a seed no warm-up uses), as the RL run will meet them, greedily and
sampled at temperature 1 (how the RL run samples: its starting reward is the sampled one):

- ``call``: the first turn is a well-formed tool call whose expression is the question's;
- ``calculator``: the share of those calls that pick the exact tool (the recipe's
  ``exact_fraction`` by design: the habit RL has to change);
- ``box``: given the tool's real result, the second turn boxes exactly that result;
- ``reward``: the demo's reward of the greedy episode (the exact answer boxed), which is what
  the RL run starts from.

Prints, per recipe, the wall time of the SFT and those four figures. ``baseline`` is the recipe
the demo used before issue 14 with the loss of then (550 steps of 32, every row run
whole, every position projected onto the vocabulary); ``demo`` is
:data:`recipes.demo.warmup.DEMO` with today's loss (the rows' shared prefix run once, only
learned positions projected: the same loss and gradients, tests/trainer/test_sft_loss.py). Extra recipes are named
``steps:batch:lr`` (e.g. ``400:16:0.001``). ``shipped`` is not trained: it evaluates the build the
package ships (``asyncrl/models/assets/tiny-arith``, built with portable numerics), as a first run
takes it. The recipes trained here run in this process with whatever kernels the CPU picks, so
their figures are those of this machine's build, not bit for bit the shipped one's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EVAL_SEED = 987_654
MAX_NEW = 48


def recipes(names: list[str]):
    from recipes.demo.warmup import DEMO

    out = {}
    for name in names:
        if name in ("demo", "shipped"):
            out[name] = DEMO
        elif name == "baseline":
            out[name] = dataclasses.replace(DEMO, steps=550, batch_size=32, lr=1e-3)
        else:
            steps, batch, lr = name.split(":")
            out[name] = dataclasses.replace(DEMO, steps=int(steps), batch_size=int(batch), lr=float(lr))
    return out


def full_projection_loss(model, ids, mask, attn):
    """The SFT loss before issue 14: every row whole, every position projected onto the vocabulary."""
    import torch

    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    targets, weights = ids[:, 1:], mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    return (nll * weights.reshape(-1)).sum() / weights.sum().clamp(min=1.0)


def train(recipe, old_loss: bool = False):
    import torch

    import trainer_daemon.sft as sft_module
    from asyncrl.models import load_model, load_tokenizer
    from recipes.demo.warmup import examples_of, sft_config

    torch.manual_seed(0)
    tok, model = load_tokenizer(recipe.base), load_model(recipe.base)
    chat, examples = examples_of(recipe, tok)
    current = sft_module.masked_lm_loss
    sft_module.masked_lm_loss = full_projection_loss if old_loss else current
    try:
        t0 = time.perf_counter()
        losses = sft_module.sft(model, examples, sft_config(recipe), tok.pad_token_id)
        seconds = time.perf_counter() - t0
    finally:
        sft_module.masked_lm_loss = current
    return model, chat, seconds, sum(losses[-20:]) / 20


def shipped():
    """The package's build of DEMO, as :func:`train` returns a model (no SFT: time and loss NaN)."""
    from asyncrl.models import load_model, load_tokenizer
    from recipes.demo.warmup import DEMO, examples_of
    from recipes.demo.warmup import shipped as shipped_build

    path = shipped_build(DEMO)
    if path is None:
        raise SystemExit("the package's tiny-arith was built by other code: run python -m recipes.demo.warmup --ship")
    tok, model = load_tokenizer(str(path)), load_model(str(path))
    chat, _examples = examples_of(DEMO, tok)
    return model.eval(), chat, float("nan"), float("nan")


def generate(model, chat, ids: list[int], sample: bool) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=sample, temperature=1.0 if sample else None,
                             top_p=1.0 if sample else None, top_k=0 if sample else None,
                             eos_token_id=chat.eos_token_id, pad_token_id=chat.eos_token_id)
    return out[0, len(ids):].tolist()


def evaluate(model, chat, n: int, sample: bool = False) -> dict[str, float]:
    """The four figures of the module doc, greedy, or sampled at T = 1 as the RL run samples."""
    import torch

    torch.manual_seed(EVAL_SEED)
    from recipes.demo.task import ArithSpec, generate_rows
    from tools.calculator import evaluate_expression, format_number
    from tools.estimate import estimate_value

    calls = calc = boxed = rewarded = 0
    for row in generate_rows(n, seed=EVAL_SEED, split="val", spec=ArithSpec.level(0)):
        expr = row["extra_info"]["expression"]
        exact = format_number(evaluate_expression(expr))
        prompt = chat.prompt_ids(row["prompt"])
        turn1 = generate(model, chat, prompt, sample)
        m = re.search(r"<tool_call>\s*(\{.*\})\s*</tool_call>", chat.decode(turn1), re.S)
        try:
            call = json.loads(m.group(1)) if m else {}
        except json.JSONDecodeError:
            call = {}
        tool, args = call.get("name"), call.get("arguments") or {}
        if tool not in ("calculator", "estimate") or args.get("expression") != expr:
            continue
        calls += 1
        calc += tool == "calculator"
        result = exact if tool == "calculator" else format_number(estimate_value(expr))
        env = chat.environment_segment([{"role": "tool", "content": result}])
        turn2 = chat.decode(generate(model, chat, prompt + turn1 + env, sample))
        box = re.findall(r"\\boxed\{([^}]*)\}", turn2)
        boxed += bool(box) and box[-1] == result
        rewarded += bool(box) and box[-1] == exact
    return {"call": calls / n, "calculator": calc / max(1, calls), "box": boxed / max(1, calls), "reward": rewarded / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default="baseline,demo")
    ap.add_argument("--eval", type=int, default=96, help="held-out questions per recipe")
    ns = ap.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'':>36}{'greedy':^26}{'sampled at T = 1':^26}")
    print(f"{'recipe':>18} {'steps':>5} {'batch':>5} {'sft s':>7} {'loss':>6}" + f" {'call':>5} {'calc':>5} {'box':>5} {'reward':>6}" * 2)
    for name, recipe in recipes(ns.recipes.split(",")).items():
        model, chat, seconds, loss = shipped() if name == "shipped" else train(recipe, old_loss=name == "baseline")
        cols = ""
        for sample in (False, True):
            q = evaluate(model, chat, ns.eval, sample)
            cols += f" {q['call']:>5.2f} {q['calculator']:>5.2f} {q['box']:>5.2f} {q['reward']:>6.2f}"
        print(f"{name:>18} {recipe.steps:>5} {recipe.batch_size:>5} {seconds:>7.1f} {loss:>6.3f}{cols}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
