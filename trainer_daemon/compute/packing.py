"""Trajectories → one packed row per micro-batch: sequences end to end, no padding (verl's
``use_remove_padding``).

Layout of a :class:`PackedMicroBatch`:

- ``input_ids`` ``(1, T)``: the micro-batch's trajectories laid end to end (``T`` = the sum of
  their lengths); ``position_ids`` ``(1, T)`` restart at 0 for every sequence; ``seq_lens``
  their lengths. Attention must stay inside each sequence: :func:`packed_attention_mask` builds
  what the model's attention implementation needs for that (transformers does **not** separate
  packed sequences from position ids alone under sdpa or eager: tests/trainer/test_packing.py).
- The *scored* tokens are the model's own response tokens (``loss_mask`` 1), the only ones a
  loss, an anchor or a reference log-prob is needed for: ``score_pos`` ``(N,)`` are the row
  positions whose output scores them (a token's position - 1), ``labels`` and ``temperature``
  ``(N,)`` their ids and the temperature their rollout log-prob refers to
  (``Trajectory.token_temperatures``). Tool and environment tokens are never projected onto the
  vocabulary. At least one position is scored (a micro-batch without model tokens scores
  position 0 with loss mask 0), so every forward builds a graph for backward.
- The loss tensors keep the padded path's response layout ``(B, R)`` (``R`` = longest
  response, at least 1): ``mask``, ``rollout_logp``, ``advantages`` exactly as
  :func:`trainer_daemon.compute.batch.collate` builds them, and ``flat_index`` ``(N,)`` places each
  scored token's result at ``row * R + offset`` of that layout (0 elsewhere). The loss code is
  therefore the same for both paths.

:func:`dummy_packed` is the all-masked stand-in for an empty micro-batch (FSDP's collectives).

Not covered: splitting one sequence across rows (a trajectory longer than the token budget is
refused where the budget is set: ``actor.ppo_max_token_len_per_gpu`` must hold
``model.max_model_len``), context parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncrl.wire import Trajectory
from trainer_daemon.compute.routes import micro_batch_routes


@dataclass
class PackedMicroBatch:
    """One packed forward pass (module docstring)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_lens: list[int]
    score_pos: torch.Tensor
    labels: torch.Tensor
    temperature: torch.Tensor
    flat_index: torch.Tensor
    mask: torch.Tensor
    rollout_logp: torch.Tensor
    advantages: torch.Tensor
    indices: list[int]
    resp_lens: list[int]
    routes: torch.Tensor | None = None
    """With router replay: ``[T, layers, top_k]`` expert ids of the packed row (-1: route live)."""

    @property
    def dummy(self) -> bool:
        return not self.indices

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def response_shape(self) -> tuple[int, int]:
        return tuple(self.mask.shape)  # type: ignore[return-value]

    def to(self, device: torch.device) -> PackedMicroBatch:
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return PackedMicroBatch(**moved)


def pack(trajs: Sequence[Trajectory], indices: Sequence[int], advantages: Sequence[float], pad_id: int) -> PackedMicroBatch:
    """The packed micro-batch of ``trajs[i] for i in indices``; ``advantages[i]`` is trajectory i's scalar advantage."""
    if not indices:
        return dummy_packed(pad_id)
    rows = [trajs[i] for i in indices]
    b, resp = len(rows), max(1, max(t.response_length for t in rows))
    ids: list[int] = []
    positions: list[int] = []
    score_pos: list[int] = []
    labels: list[int] = []
    temps: list[float] = []
    flat: list[int] = []
    mask = torch.zeros((b, resp), dtype=torch.float32)
    rollout = torch.zeros((b, resp), dtype=torch.float32)
    adv = torch.zeros((b, resp), dtype=torch.float32)
    for r, (i, t) in enumerate(zip(indices, rows, strict=True)):
        start, p, m = len(ids), t.prompt_length, t.response_length
        ids.extend(t.token_ids)
        positions.extend(range(len(t.token_ids)))
        if not m:
            continue
        lm = torch.tensor(t.loss_mask, dtype=torch.float32)
        mask[r, :m] = lm
        rollout[r, :m] = torch.tensor(t.behaviour_logprob_list(), dtype=torch.float32) * lm
        adv[r, :m] = float(advantages[i]) * lm
        token_temps = t.token_temperatures()
        for k, learned in enumerate(t.loss_mask):
            if learned:
                score_pos.append(start + p + k - 1)
                labels.append(t.token_ids[p + k])
                temps.append(token_temps[k])
                flat.append(r * resp + k)
    if not score_pos:  # no model token at all: score position 0, masked out, so backward still runs
        score_pos, labels, temps, flat = [0], [pad_id], [1.0], [0]
    return PackedMicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long), position_ids=torch.tensor([positions], dtype=torch.long),
        seq_lens=[len(t.token_ids) for t in rows], score_pos=torch.tensor(score_pos, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long), temperature=torch.tensor(temps, dtype=torch.float32),
        flat_index=torch.tensor(flat, dtype=torch.long), mask=mask, rollout_logp=rollout, advantages=adv,
        indices=list(indices), resp_lens=[t.response_length for t in rows],
        routes=micro_batch_routes(rows, [sum(len(t.token_ids) for t in rows[:r]) for r in range(b)], len(ids)),
    )


def dummy_packed(pad_id: int) -> PackedMicroBatch:
    """Two pad tokens, one scored position with loss mask 0: a forward/backward that changes nothing."""
    z = torch.zeros((1, 1), dtype=torch.float32)
    return PackedMicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long), position_ids=torch.arange(2).unsqueeze(0), seq_lens=[2],
        score_pos=torch.zeros(1, dtype=torch.long), labels=torch.full((1,), pad_id, dtype=torch.long),
        temperature=torch.ones(1), flat_index=torch.zeros(1, dtype=torch.long), mask=z, rollout_logp=z.clone(),
        advantages=z.clone(), indices=[], resp_lens=[],
    )


def document_ids(seq_lens: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``(T,)``: the index of the sequence each packed position belongs to. Built on the host
    and copied without blocking (on CUDA a blocking copy, or ``repeat_interleave`` on the device,
    would wait for the queued kernels)."""
    lens = torch.tensor(list(seq_lens), dtype=torch.long)
    doc = torch.repeat_interleave(torch.arange(len(lens)), lens)
    dev = torch.device(device)
    return doc.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else doc.to(dev)


def packed_attention_mask(seq_lens: Sequence[int], attn_implementation: str, device: torch.device | str = "cpu"):
    """What ``attention_mask`` a packed row needs under ``attn_implementation``:

    - ``flash_attention_2`` / ``flash_attention_3``: None (transformers derives the varlen
      boundaries from ``position_ids``);
    - ``segmented_sdpa`` (:mod:`trainer_daemon.policy.segmented_attention`): None (it takes the
      boundaries from ``cu_seq_lens_q``);
    - ``flex_attention``: a ``BlockMask`` (block-diagonal causal, from the document ids);
    - anything else (``sdpa``; also ``eager``, which takes an additive float mask): a 4-D
      ``(1, 1, T, T)`` block-diagonal causal mask, boolean for sdpa (transformers passes a 4-D
      mask through unchanged). O(T²) memory and work: slow on GPU (use flex there) and on
      the CPU (segmented_sdpa there).
    """
    if attn_implementation.startswith("flash_attention") or attn_implementation == "segmented_sdpa":
        return None
    doc = document_ids(seq_lens, device)
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        def causal_in_document(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)

        t = int(doc.shape[0])
        return create_block_mask(causal_in_document, B=None, H=None, Q_LEN=t, KV_LEN=t, device=str(device))
    t = int(doc.shape[0])
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool, device=device).tril()
    if attn_implementation == "eager":
        return torch.zeros(t, t, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    return allowed[None, None]
