"""The engines' model in the test process, for comparing what an engine returns with a
forward pass of the same weights: teacher-forced logprobs and greedy continuations."""

from __future__ import annotations

import torch

from tests.helpers.processes import MODEL, SEED


def load_reference_model():
    """The test engines' model, built in this process (same spec and seed), float32, eval."""
    from asyncrl.models import load_model

    return load_model(MODEL, dtype="float32", seed=SEED)


@torch.inference_mode()
def teacher_forced_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each output token given prompt + the outputs before it."""
    if not output:
        return []
    ids = torch.tensor([prompt + output])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1].float()
    t = 1.0 if temperature < 1e-6 else temperature
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1).tolist()


@torch.inference_mode()
def greedy_continuation(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of ``model`` after ``prompt`` (no EOS stop), by full forward passes."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
def in_place_logprobs(old, new, prompt: list[int], output: list[int], k: int) -> list[float]:
    """What an ``in_place`` sync after ``k`` output tokens gives ``output[k:]``: the KV of the
    prompt and ``output[:k-1]`` computed by ``old`` (kept across the sync), then ``new`` feeds
    ``output[k-1]`` onwards over it (the last old token was sampled, not yet fed)."""
    if k < 1 or k >= len(output):
        raise ValueError(f"a boundary at {k} of {len(output)} tokens leaves nothing to compare")
    kv = old(input_ids=torch.tensor([prompt + output[:k - 1]]), use_cache=True).past_key_values
    logits = new(input_ids=torch.tensor([output[k - 1:-1]]), past_key_values=kv, use_cache=True).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(output[k:]).unsqueeze(1)).squeeze(1).tolist()
