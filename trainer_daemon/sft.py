"""A small supervised fine-tune on token sequences: the warm-up that turns a random builtin
model into a policy that already speaks the task's format (tool calls, boxed answers).

Input: examples of ``(token_ids, loss_mask)`` (mask 1 on the tokens to learn — the model's
turns — and 0 on prompt and tool/environment tokens). Single process, CPU or GPU, AdamW,
padded batches, loss averaged over masked tokens. The AdamW is torch's fused one: besides being
faster, its square root is an exact IEEE instruction on every CPU, where ``torch.sqrt`` on CPU
goes through MKL's VML and rounds differently on Intel and AMD
(:mod:`trainer_daemon.compute.portable_numerics`). Output: a Hugging Face directory
(safetensors + tokenizer) that every component can load as ``model.path``.

Not covered: distributed SFT, packing, long sequences (this is a warm-up for small models).
"""

from __future__ import annotations

import inspect
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SftConfig:
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    seed: int = 0
    log_every: int = 50


def _batch(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.float32)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (toks, m) in enumerate(examples):
        ids[row, : len(toks)] = torch.tensor(toks)
        mask[row, : len(m)] = torch.tensor(m, dtype=torch.float32)
        attn[row, : len(toks)] = 1
    return ids, mask, attn


def shared_prefix_length(ids: torch.Tensor, attn: torch.Tensor) -> int:
    """How many leading tokens every row of the batch has in common (and attends to)."""
    same = ((ids == ids[:1]) & (attn > 0)).all(0).long()
    return int(same.cumprod(0).sum())


def decoder_states(model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states of a batch, ``[B, T, H]``. The rows' common prefix (the
    demo's examples share a ~120-token system prompt of their 200) runs once and its keys and
    values are repeated for every row: the same states and gradients as running it B times."""
    decoder = model.get_decoder()
    shared = min(shared_prefix_length(ids, attn), ids.shape[1] - 1)
    if ids.shape[0] == 1 or shared < 2:
        return decoder(input_ids=ids, attention_mask=attn).last_hidden_state
    prefix = decoder(input_ids=ids[:1, :shared], use_cache=True)
    # transformers >= 5.2x calls the key/value cache ``cache``; earlier 5.x ``past_key_values``
    cache = getattr(prefix, "cache", None) or prefix.past_key_values
    cache.batch_repeat_interleave(ids.shape[0])
    arg = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    rest = decoder(input_ids=ids[:, shared:], attention_mask=attn, **{arg: cache}).last_hidden_state
    return torch.cat([prefix.last_hidden_state.expand(ids.shape[0], -1, -1), rest], dim=1)


def masked_lm_loss(model, ids: torch.Tensor, mask: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose *target* has mask 1.

    The output projection runs only at those positions (a warm-up learns a few dozen tokens
    of a ~200-token example: projecting all of them onto the vocabulary was a fifth of the
    step), on :func:`decoder_states`; the result is the full projection's, restricted."""
    hidden = decoder_states(model, ids, attn)[:, :-1]
    learn = mask[:, 1:] > 0
    logits = model.get_output_embeddings()(hidden[learn]).float()
    return torch.nn.functional.cross_entropy(logits, ids[:, 1:][learn]) if logits.numel() else hidden.sum() * 0.0


def sft(model, examples: Sequence[tuple[list[int], list[int]]], cfg: SftConfig, pad_id: int,
        on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Train ``model`` in place; return the loss of every step. ``on_step(step, loss)`` is
    called after every step (1-based), e.g. to show progress."""
    if not examples:
        raise ValueError("no SFT examples")
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    losses = []
    t0 = time.monotonic()
    for step in range(cfg.steps):
        ids, mask, attn = _batch(rng.sample(list(examples), min(cfg.batch_size, len(examples))), pad_id)
        loss = masked_lm_loss(model, ids, mask, attn)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step + 1, losses[-1])
        if cfg.log_every and (step + 1) % cfg.log_every == 0:
            log.info("sft step %d/%d loss %.4f (%.1f s)", step + 1, cfg.steps, losses[-1], time.monotonic() - t0)
    model.eval()
    return losses


def save_hf(model, tokenizer, out_dir: Path | str) -> Path:
    """Write a loadable Hugging Face directory atomically (``COMPLETE`` marks it whole)."""
    import os
    import shutil

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".incomplete")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "COMPLETE").write_text("asyncrl sft warm-up\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
