"""Which reasoning-gym tasks can a model already partly solve? The starting reward of an RL run.

    .venv/bin/python bench/task_probe.py [--model builtin:smollm2-135m] [--problems 32] [--samples 2] \
        [--answer tag|tag_or_last_number] [--tasks 'basic_arithmetic:{"min_terms":2,"max_terms":2,"min_digits":1,"max_digits":1}' ...]

RL needs a task the policy solves sometimes: never, and every group's advantages are zero;
always, and there is nothing to learn. For each task (``name`` or ``name:{json options}``)
this renders the prompts exactly as the rollout service does (reasoning-gym's system prompt,
the model's chat template), samples ``--samples`` answers per problem at temperature 1 (as
training samples them) with ``--max-new-tokens``, and scores them with the task's own
verifier through asyncrl's reward (:class:`rollout_service.rewards.ReasoningGymReward`; with
``--answer tag_or_last_number`` a response without an ``<answer>`` tag is judged on its last
number, ``data.source_answer``).
Prints per task: mean reward, the share of answers with an ``<answer>`` tag, the share of
problems solved at least once, the mean response length and the time taken.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH = 16
DEFAULT_TASKS = [
    'basic_arithmetic:{"min_terms":2,"max_terms":2,"min_digits":1,"max_digits":1}',
    'chain_sum:{"min_terms":2,"max_terms":2,"min_digits":1,"max_digits":1}',
    "leg_counting",
    'number_sorting:{"min_numbers":3,"max_numbers":3}',
    "coin_flip",
    "spell_backward",
]


def parse_task(spec: str) -> tuple[str, dict]:
    name, _, opts = spec.partition(":")
    return name, json.loads(opts) if opts else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--tasks", nargs="*", default=DEFAULT_TASKS)
    ap.add_argument("--answer", choices=("tag", "tag_or_last_number"), default="tag",
                    help="data.source_answer: how an answer is read (a tag; or, with none, the last number)")
    ns = ap.parse_args()

    import torch

    from asyncrl.chat import ChatTokenizer
    from asyncrl.models import load_model, load_tokenizer
    from rollout_service.data.reasoning_gym_task import rows
    from rollout_service.rewards.reasoning_gym_reward import ReasoningGymReward

    torch.manual_seed(0)
    tok, model = load_tokenizer(ns.model), load_model(ns.model)
    model.eval()
    chat = ChatTokenizer(tok, [])
    print(f"model {ns.model}, {ns.problems} problems x {ns.samples} samples, T=1, max {ns.max_new_tokens} new tokens")
    print(f"{'task':>70} {'reward':>6} {'tagged':>6} {'solved':>6} {'len':>5} {'s':>6}")
    fallback = "last_number" if ns.answer == "tag_or_last_number" else None
    for spec in ns.tasks:
        name, opts = parse_task(spec)
        t0 = time.perf_counter()
        problems = rows(name, opts, ns.problems, 0, "train")
        reward = ReasoningGymReward(name, opts, ns.problems, 0, 0, answer_fallback=fallback)
        jobs = [row for row in problems for _ in range(ns.samples)]
        scores, tagged, lengths, best = [], 0, [], {}
        for start in range(0, len(jobs), BATCH):  # left-padded batches: one generate call per BATCH samples
            chunk = jobs[start:start + BATCH]
            prompts = [chat.prompt_ids(row["prompt"]) for row in chunk]
            width = max(map(len, prompts))
            pad = tok.pad_token_id if tok.pad_token_id is not None else chat.eos_token_id
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0,
                                     max_new_tokens=ns.max_new_tokens, eos_token_id=chat.eos_token_id, pad_token_id=pad)
            for row, seq in zip(chunk, out[:, width:].tolist()):
                seq = seq[: seq.index(chat.eos_token_id) + 1] if chat.eos_token_id in seq else seq
                res = reward(chat.decode_turn(seq), row["reward_model"]["ground_truth"], row["extra_info"])
                scores.append(res.score)
                tagged += res.details.get("answer_from") == "tag"
                lengths.append(len(seq))
                key = row["extra_info"]["index"]
                best[key] = max(best.get(key, 0.0), res.score)
        n = len(scores)
        solved = sum(1 for v in best.values() if v > 0)
        print(f"{spec:>70} {sum(scores) / n:>6.3f} {tagged / n:>6.2f} {solved / len(problems):>6.2f} "
              f"{sum(lengths) / n:>5.0f} {time.perf_counter() - t0:>6.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
