"""Timing mode: a :class:`ModelRunner` that computes nothing and only takes time.

For benchmarks of the whole system (``bench/modes.py``) where what matters is how rollout,
training and syncs overlap, not what the model says. Each decode step sleeps
``decode_ms`` (one batched step of a GPU engine costs about the same whatever the batch
size), a prefill sleeps ``prefill_ms_per_token`` per prompt token, and every new row draws
a response length from a long-tailed log-normal distribution (``length_median``,
``length_sigma``, capped at ``length_max``): the returned logits put almost all mass on a
filler token until the row reaches its length, then on the end-of-sequence token. The
same seed gives the same lengths.

A row dropped before its length (an abort, a retract) is remembered by its context (prompt +
tokens so far, the pending filler token included): a later prefill of exactly that context
(the rollout's resend after an abort, the engine's own re-prefill after a retract) continues
the same draw instead of drawing a new length, so every pause policy sees the same workload,
and its tokens are counted as recomputed (``recomputed_tokens``:
``local_engine_recomputed_prefill_tokens_total``). At most ``REMEMBERED_ROWS`` are kept.

Weights are still a real model's tensors (by Hugging Face names) so weight updates run the
real protocol and move the real bytes; they are never used for compute. Not covered:
realistic text, logprobs that mean anything, prefix caching effects.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict

import torch

from asyncrl.config.sections_engines import TimingSection
from local_engine.runner import ModelRunner, PrefillOutput

PEAK_LOGIT = 30.0  # softmax of 30 vs 0 over a few thousand tokens: the peak gets > 0.9999
REMEMBERED_ROWS = 4096  # interrupted rows kept for a resume, two keys each (oldest forgotten first)


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
        self._contexts: list[list[int]] = []
        self._interrupted: OrderedDict[int, tuple[int, int, int]] = OrderedDict()  # hash(context) -> (target, produced, other key)
        self.recomputed_tokens = 0

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
        for prompt in prompts:
            resumed = self._interrupted.pop(hash(tuple(prompt)), None)
            if resumed is None:
                target, produced = self.draw_length(), 0
            else:
                target, produced, sibling = resumed
                self._interrupted.pop(sibling, None)
                self.recomputed_tokens += len(prompt)
            self._targets.append(target)
            self._produced.append(produced)
            self._contexts.append(list(prompt))
        last = self._logits()[start:]
        prompt = [torch.zeros((len(p), self.vocab_size)) if want else None for p, want in zip(prompts, full_logits)]
        return PrefillOutput(last=last, prompt=prompt)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        time.sleep(self.spec.decode_ms / 1000.0)
        self._produced = [p + 1 for p in self._produced]
        for ctx, t in zip(self._contexts, tokens, strict=True):
            ctx.append(t)
        return self._logits()

    def keep(self, indices: list[int]) -> None:
        kept = set(indices)
        self._remember([i for i in range(len(self._targets)) if i not in kept])
        self._targets = [self._targets[i] for i in indices]
        self._produced = [self._produced[i] for i in indices]
        self._contexts = [self._contexts[i] for i in indices]

    def reset(self) -> None:
        self._remember(range(len(self._targets)))
        self._targets, self._produced, self._contexts = [], [], []

    def _remember(self, rows) -> None:
        """Rows dropped before their length, keyed by the context a resume would prefill: with
        the pending filler token (dropped between steps), or without it (an abort discarded the
        step that sampled it). Identical contexts (same prompt, same progress) share an entry."""
        for i in rows:
            target, produced = self._targets[i], self._produced[i]
            if produced + 1 < target:  # the pending token is a filler: the row was not done
                pending, discarded = hash((*self._contexts[i], self.filler)), hash(tuple(self._contexts[i]))
                self._interrupted[pending] = (target, produced + 1, discarded)
                self._interrupted[discarded] = (target, produced, pending)
                self._interrupted.move_to_end(pending)
        while len(self._interrupted) > 2 * REMEMBERED_ROWS:
            self._interrupted.popitem(last=False)

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self._weights
