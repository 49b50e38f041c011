"""Timing mode: a :class:`ModelRunner` that computes nothing and only takes time.

For benchmarks of the whole system (``bench/modes.py``) where what matters is how rollout,
training and syncs overlap, not what the model says. Each decode step sleeps
``decode_ms`` (one batched step of a GPU engine costs about the same whatever the batch
size), a prefill sleeps ``prefill_ms_per_token`` per prompt token, and every new row draws
a response length from a long-tailed log-normal distribution (``length_median``,
``length_sigma``, capped at ``length_max``): the returned logits put almost all mass on a
filler token until the row reaches its length, then on the end-of-sequence token. The
same seed gives the same lengths.

Weights are still a real model's tensors (by Hugging Face names) so weight updates run the
real protocol and move the real bytes; they are never used for compute. Not covered:
realistic text, logprobs that mean anything, prefix caching effects.
"""

from __future__ import annotations

import math
import random
import time

import torch

from asyncrl.config.sections_engines import TimingSection
from local_engine.runner import ModelRunner, PrefillOutput

PEAK_LOGIT = 30.0  # softmax of 30 vs 0 over a few thousand tokens: the peak gets > 0.9999


class SimulatedRunner(ModelRunner):
    """``spec``: the ``timing`` settings (``engines.local.timing``); ``seed``: of the length draws."""

    def __init__(self, weights: dict[str, torch.Tensor], vocab_size: int, eos_token_id: int, spec: TimingSection,
                 seed: int, filler_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos = eos_token_id
        self.filler = filler_token_id if filler_token_id is not None else (eos_token_id + 1) % vocab_size
        self.spec = spec
        self.rng = random.Random(seed)
        self._weights = weights
        self._targets: list[int] = []
        self._produced: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self._targets)

    def draw_length(self) -> int:
        s = self.spec
        value = math.exp(math.log(max(1.0, s.length_median)) + s.length_sigma * self.rng.gauss(0.0, 1.0))
        return max(1, min(s.length_max, int(round(value))))

    def _logits(self) -> torch.Tensor:
        out = torch.zeros((len(self._targets), self.vocab_size), dtype=torch.float32)
        for i, (target, produced) in enumerate(zip(self._targets, self._produced)):
            out[i, self.eos if produced + 1 >= target else self.filler] = PEAK_LOGIT
        return out

    def prefill(self, prompts: list[list[int]], full_logits: list[bool]) -> PrefillOutput:
        time.sleep(self.spec.prefill_ms_per_token * sum(len(p) for p in prompts) / 1000.0)
        start = len(self._targets)
        for _ in prompts:
            self._targets.append(self.draw_length())
            self._produced.append(0)
        last = self._logits()[start:]
        prompt = [torch.zeros((len(p), self.vocab_size)) if want else None for p, want in zip(prompts, full_logits)]
        return PrefillOutput(last=last, prompt=prompt)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        time.sleep(self.spec.decode_ms / 1000.0)
        self._produced = [p + 1 for p in self._produced]
        return self._logits()

    def keep(self, indices: list[int]) -> None:
        self._targets = [self._targets[i] for i in indices]
        self._produced = [self._produced[i] for i in indices]

    def reset(self) -> None:
        self._targets, self._produced = [], []

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self._weights
