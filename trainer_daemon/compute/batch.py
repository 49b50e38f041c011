"""Trajectories → the tensors of one micro-batch forward pass.

Layout: ``input_ids``/``attention_mask`` are ``(B, L)``, right-padded with ``pad_id``
(positions count from 0 in every row, so the default position ids are right). Response token
``t`` of row ``i`` sits at ``prompt_length_i + t``; the logits that score it are at the position
before. The model is asked only for logits from ``first_pos`` on (``logits_to_keep``),
``first_pos = min_i(prompt_length_i) - 1``, and ``resp_index`` ``(B, R)`` points into those
kept positions. Per response token (``R`` = longest response, at least 1) the micro-batch holds
``labels``, the loss ``mask`` (the trajectory's ``loss_mask``, 0 on padding),
``rollout_logp`` (the behaviour policy's log-prob: ``Trajectory.behaviour_logprob_list``, the
truncated distribution's where the engine reported it), and ``advantages`` (the trajectory's
scalar advantage on masked tokens).
``temperature`` ``(B, R)`` is the temperature each response token's rollout logprob refers
to (``Trajectory.token_temperatures``: per sampling span, 1 for greedy; 1 on padding): the
logits that score a token are divided by it before the log-softmax, as the engine did.

:func:`dummy_micro_batch` is the all-masked stand-in a rank runs when the plan gives it an empty
micro-batch: FSDP's collectives need the same number of forward/backward passes everywhere.

Not covered: packing several sequences into one row (no padding waste), left padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncrl.wire import Trajectory
from trainer_daemon.compute.routes import micro_batch_routes


@dataclass
class MicroBatch:
    """One forward pass worth of tensors (module docstring)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    resp_index: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    rollout_logp: torch.Tensor
    advantages: torch.Tensor
    temperature: torch.Tensor
    indices: list[int]
    resp_lens: list[int]
    routes: torch.Tensor | None = None
    """With router replay: ``[rows × width, layers, top_k]`` expert ids in ``input_ids``' order
    (:func:`trainer_daemon.compute.routes.micro_batch_routes`; -1 where the router routes live)."""

    @property
    def dummy(self) -> bool:
        return not self.indices

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum().item())

    def to(self, device: torch.device) -> MicroBatch:
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**moved)


def collate(
    trajs: Sequence[Trajectory],
    indices: Sequence[int],
    advantages: Sequence[float],
    pad_id: int,
) -> MicroBatch:
    """The micro-batch of ``trajs[i] for i in indices``; ``advantages[i]`` is trajectory i's scalar advantage."""
    if not indices:
        return dummy_micro_batch(pad_id)
    rows = [trajs[i] for i in indices]
    width = max(len(t.token_ids) for t in rows)
    resp = max(1, max(t.response_length for t in rows))
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    labels = torch.zeros((b, resp), dtype=torch.long)
    mask = torch.zeros((b, resp), dtype=torch.float32)
    rollout = torch.zeros((b, resp), dtype=torch.float32)
    adv = torch.zeros((b, resp), dtype=torch.float32)
    first = min(t.prompt_length for t in rows) - 1
    index = torch.zeros((b, resp), dtype=torch.long)
    for r, (i, t) in enumerate(zip(indices, rows, strict=True)):
        n, p = len(t.token_ids), t.prompt_length
        input_ids[r, :n] = torch.tensor(t.token_ids, dtype=torch.long)
        attn[r, :n] = 1
        m = t.response_length
        if m:
            labels[r, :m] = torch.tensor(t.token_ids[p:], dtype=torch.long)
            mask[r, :m] = torch.tensor(t.loss_mask, dtype=torch.float32)
            rollout[r, :m] = torch.tensor(t.behaviour_logprob_list(), dtype=torch.float32)
            adv[r, :m] = float(advantages[i]) * mask[r, :m]
        pos = torch.arange(resp) + (p - 1)
        index[r] = pos.clamp(max=width - 2 if width > 1 else 0) - first
    rollout = torch.where(mask.bool(), rollout, torch.zeros_like(rollout))
    temps = torch.ones((b, resp), dtype=torch.float32)
    for r, t in enumerate(rows):
        if t.response_length:
            temps[r, :t.response_length] = torch.tensor(t.token_temperatures(), dtype=torch.float32)
    return MicroBatch(
        input_ids=input_ids, attention_mask=attn, logits_to_keep=width - first, resp_index=index,
        labels=labels, mask=mask, rollout_logp=rollout, advantages=adv, temperature=temps,
        indices=list(indices), resp_lens=[t.response_length for t in rows],
        routes=micro_batch_routes(rows, [r * width for r in range(b)], b * width),
    )


def dummy_micro_batch(pad_id: int) -> MicroBatch:
    """Two pad tokens, one masked-out response token: a forward/backward that changes nothing."""
    z = torch.zeros((1, 1), dtype=torch.float32)
    return MicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long), attention_mask=torch.ones((1, 2), dtype=torch.long),
        logits_to_keep=2, resp_index=torch.zeros((1, 1), dtype=torch.long), labels=torch.full((1, 1), pad_id, dtype=torch.long),
        mask=z, rollout_logp=z.clone(), advantages=z.clone(), temperature=torch.ones((1, 1)), indices=[], resp_lens=[],
    )
