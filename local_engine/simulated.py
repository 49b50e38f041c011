"""Timing mode: a :class:`ModelRunner` that computes nothing and only takes time.

For benchmarks of the whole system (``bench/modes.py``) where what matters is how rollout,
training and syncs overlap, not what the model says. Each decode step sleeps
``decode_ms`` (one batched step of a GPU engine costs about the same whatever the batch
size), a prefill sleeps ``prefill_ms_per_token`` per prompt token, and every new row draws
a response length from a long-tailed log-normal distribution (``length_median``,
``length_sigma``, capped at ``length_max``): the returned logits put almost all mass on a
filler token until the row reaches its length, then on the end-of-sequence token. The engine
makes the filler the token of ``x``: plain text, so a filler response is content and ends an
agent's episode (a special token could read as markup; in the builtin tokenizers the id
after the end of sequence is ``<tool_call>``, which made every response an unterminated
tool call and every trajectory run to the turn limit before 2026-11-23). The
same seed gives the same lengths.

Tool turns (``tool_call`` and ``tool_turns`` set): a response whose context holds fewer than
``tool_turns`` copies of the tool call's tokens ends with them (filler, then the call, then
end of sequence; at least the call), so an agent parses a tool call, runs the tool and sends
the next turn: multi-turn trajectories whose turn count the benchmark chooses.

A row dropped before its length (an abort, a retract) is remembered by its context (prompt +
tokens so far, the pending filler token included): a later prefill of exactly that context
(the rollout's resend after an abort, the engine's own re-prefill after a retract) continues
the same draw instead of drawing a new length, so every pause policy sees the same workload,
and its tokens are counted as recomputed (``recomputed_tokens``:
``local_engine_recomputed_prefill_tokens_total``). At most ``REMEMBERED_ROWS`` are kept.

Weights are still a real model's tensors (by Hugging Face names) so weight updates run the
real protocol and move the real bytes; they are never used for compute. LoRA adapters are
loaded, checked and unloaded as on a computing engine (the adapter routes run their real
protocol too) and never applied. Not covered:
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
# A hermes tool call of the builtin calculator: the ``tool_call`` text benchmarks and tests use.
CALCULATOR_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


class SimulatedRunner(ModelRunner):
    """``spec``: the ``timing`` settings (``engines.local.timing``); ``seed``: of the length draws."""

    def __init__(self, weights: dict[str, torch.Tensor], vocab_size: int, eos_token_id: int, spec: TimingSection,
                 seed: int, filler_token_id: int | None = None, tool_call_ids: list[int] | None = None,
                 model: torch.nn.Module | None = None) -> None:
        self.vocab_size = vocab_size
        self.model = model
        """The module ``weights`` belong to: LoRA adapters are checked against its layers and
        loaded as on a computing engine, never run (``adapters`` of a prefill are ignored)."""
        self.eos = eos_token_id
        self.filler = filler_token_id if filler_token_id is not None else (eos_token_id + 1) % vocab_size
        self.spec = spec
        self.rng = random.Random(seed)
        self._weights = weights
        self._call = tuple(tool_call_ids or ()) if spec.tool_turns > 0 else ()
        self._scripted: list[bool] = []  # per row: its response ends with the tool call
        self._targets: list[int] = []
        self._produced: list[int] = []
        self._contexts: list[list[int]] = []
        self._interrupted: OrderedDict[int, tuple[int, int, int, bool]] = OrderedDict()  # hash(context) -> (target, produced, other key, scripted)
        self.recomputed_tokens = 0

    @property
    def num_rows(self) -> int:
        return len(self._targets)

    def draw_length(self) -> int:
        s = self.spec
        value = math.exp(math.log(max(1.0, s.length_median)) + s.length_sigma * self.rng.gauss(0.0, 1.0))
        return max(1, min(s.length_max, int(round(value))))

    def _calls_in(self, context: list[int]) -> int:
        """Copies of the tool call's tokens in ``context``."""
        call, n, count, i = self._call, len(self._call), 0, 0
        first = call[0]
        while True:
            try:
                i = context.index(first, i)
            except ValueError:
                return count
            if tuple(context[i:i + n]) == call:
                count += 1
                i += n
            else:
                i += 1

    def _next_token(self, target: int, produced: int, scripted: bool) -> int:
        if produced + 1 >= target:
            return self.eos
        call_at = target - 1 - len(self._call)
        if scripted and produced >= call_at:
            return self._call[produced - call_at]
        return self.filler

    def _logits(self) -> torch.Tensor:
        out = torch.zeros((len(self._targets), self.vocab_size), dtype=torch.float32)
        for i, (target, produced, scripted) in enumerate(zip(self._targets, self._produced, self._scripted)):
            out[i, self._next_token(target, produced, scripted)] = PEAK_LOGIT
        return out

    def prefill(self, prompts: list[list[int]], full_logits: list[bool], adapters: list | None = None,
                prefixes: list | None = None) -> PrefillOutput:
        time.sleep(self.spec.prefill_ms_per_token * sum(len(p) for p in prompts) / 1000.0)
        start = len(self._targets)
        for prompt in prompts:
            resumed = self._interrupted.pop(hash(tuple(prompt)), None)
            if resumed is None:
                target, produced = self.draw_length(), 0
                scripted = bool(self._call) and self._calls_in(prompt) < self.spec.tool_turns
                if scripted:
                    target = max(target, len(self._call) + 1)
            else:
                target, produced, sibling, scripted = resumed
                self._interrupted.pop(sibling, None)
                self.recomputed_tokens += len(prompt)
            self._scripted.append(scripted)
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
        self._scripted = [self._scripted[i] for i in indices]

    def reset(self) -> None:
        self._remember(range(len(self._targets)))
        self._targets, self._produced, self._contexts, self._scripted = [], [], [], []

    def _remember(self, rows) -> None:
        """Rows dropped before their length, keyed by the context a resume would prefill: with
        the pending token (dropped between steps), or without it (an abort discarded the
        step that sampled it). Identical contexts (same prompt, same progress) share an entry."""
        for i in rows:
            target, produced, scripted = self._targets[i], self._produced[i], self._scripted[i]
            if produced + 1 < target:  # the pending token is not the end: the row was not done
                token = self._next_token(target, produced, scripted)
                pending, discarded = hash((*self._contexts[i], token)), hash(tuple(self._contexts[i]))
                self._interrupted[pending] = (target, produced + 1, discarded, scripted)
                self._interrupted[discarded] = (target, produced, pending, scripted)
                self._interrupted.move_to_end(pending)
        while len(self._interrupted) > 2 * REMEMBERED_ROWS:
            self._interrupted.popitem(last=False)

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self._weights
