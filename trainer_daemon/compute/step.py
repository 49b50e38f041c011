"""One training step: ``require_batches * ppo_mini_batch_size`` groups → optimiser updates.

Every rank receives the whole step batch (the same list of trajectories in the same order),
so everything that depends on the batch alone is computed identically everywhere, without
collectives: the outcome advantages (``actor.adv_estimator``, ``actor.norm_adv_by_std_in_grpo``), the zero-variance filter
(``actor.filter_zero_variance_groups``), the split into mini-batches of
``ppo_mini_batch_size`` groups, the per-rank plan (``algo.plan_mini_batch``: whole groups per
rank, token-balanced, equal micro-batch counts) and the mini-batch's global loss normalisers.

Per step: if ``compute_prox_log_prob`` (or ``use_rollout_log_probs=False``) one no-grad pass
computes the anchor log-probs with the weights at the start of the step; with
``actor.use_kl_loss`` one no-grad pass of the frozen reference. Then ``ppo_epochs`` × each
mini-batch: for each of this rank's micro-batches a forward pass (logits / the trajectory's
temperature), ``algo.compute_actor_loss`` with global normalisers and ``dp_size``, backward;
then gradient clipping (``actor.optim.grad_clip``), AdamW, LR schedule. A non-finite gradient
norm skips that update on every rank (the norm is global). Empty micro-batches run
:func:`~trainer_daemon.compute.batch.dummy_micro_batch` so FSDP's collectives line up.

Metrics (verl's names): ``actor/*`` from the loss (loss terms summed over micro-batches and
averaged over ranks — the mini-batch value; ratios and fractions token-weighted means),
``actor/grad_norm``, ``actor/lr``, ``critic/rewards/*``, ``response_length/*``,
``perf/total_num_tokens``, ``perf/throughput`` (tokens/s per rank, verl's), ``timing_s/*``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from asyncrl.config import RunConfig
from asyncrl.config.sections_core import AsyncTrainingConfig
from asyncrl.config.sections_infra import ActorConfig
from asyncrl.wire import Trajectory
from trainer_daemon.algo import (
    compute_actor_loss,
    log_probs_and_entropy,
    log_probs_from_logits,
    outcome_advantages,
    plan_mini_batch,
    resolve_log_probs,
    zero_variance_mask,
)
from trainer_daemon.compute.batch import MicroBatch, collate
from trainer_daemon.compute.logprob_head import log_prob_head
from trainer_daemon.compute.packing import PackedMicroBatch, pack, packed_attention_mask
from trainer_daemon.compute.router_replay import RouterReplay
from trainer_daemon.policy.distributed import DistContext
from trainer_daemon.policy.segmented_attention import NAME as SEGMENTED
from trainer_daemon.policy.segmented_attention import cu_seq_lens


@dataclass
class Prefetched:
    """A micro-batch already on the device (``TrainStep._prefetch``), what the loop reads of it
    on the host, and its packed attention mask once built."""

    mb: MicroBatch | PackedMicroBatch
    mass: float
    scaled: bool
    attn: Any = None


SHARE_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss")  # summed over micro-batches


@dataclass(frozen=True)
class StepSettings:
    """What a step reads: the run config's ``actor`` and ``async_training`` sections as they
    are (no copied knobs), and the tokenizer's pad id."""

    actor: ActorConfig
    async_training: AsyncTrainingConfig
    pad_id: int

    @classmethod
    def from_config(cls, cfg: RunConfig, pad_id: int) -> StepSettings:
        return cls(cfg.actor, cfg.async_training, pad_id)


class TrainStep:
    """Callable step function (module docstring); identical on every rank."""

    def __init__(self, model, optimizer, scheduler, settings: StepSettings, ctx: DistContext, reference=None) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.s, self.ctx, self.reference = settings, ctx, reference
        if settings.actor.use_kl_loss and reference is None:
            raise ValueError("actor.use_kl_loss needs a reference model")
        self.replays: dict[int, RouterReplay] = {}
        """Per model (policy, reference) under ``actor.router_replay.mode = "R3"`` (:mod:`.router_replay`)."""
        if settings.actor.router_replay.mode == "R3":
            for m in (model, reference):
                if m is not None:
                    self.replays[id(m)] = RouterReplay(m, count=m is model)  # the policy's flips only

    def _replaying(self, model, mb: MicroBatch | PackedMicroBatch):
        """Replay ``mb``'s routes in ``model``'s forwards (and backward recompute) in the block;
        a micro-batch without routes under R3 routes live (a dummy: no token is scored)."""
        replay = self.replays.get(id(model))
        return replay.active(mb.routes) if replay is not None else contextlib.nullcontext()

    # -- forward ---------------------------------------------------------------------------
    def _prefetch(self, mb: MicroBatch | PackedMicroBatch) -> Prefetched:
        """``mb`` on the device before the micro-batch loop, copied from pinned memory without
        blocking, plus what the loop reads on the host: no device synchronisation between the
        passes (a blocking copy in the loop would wait for the queued forward each time)."""
        mass = float(mb.mask.sum())
        scaled = bool((mb.temperature != 1.0).any())
        dev = self.ctx.device
        if dev.type == "cuda":
            mb = mb.__class__(**{k: (v.pin_memory().to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                                 for k, v in mb.__dict__.items()})
        else:
            mb = mb.to(dev)
        attn = None
        if isinstance(mb, PackedMicroBatch):  # built now, before the passes: its construction may synchronise
            attn = packed_attention_mask(mb.seq_lens, self.model.config._attn_implementation, dev)
        return Prefetched(mb, mass, scaled, attn)

    def _forward(self, model, item: Prefetched | MicroBatch | PackedMicroBatch,
                 entropy: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logp, entropy)``, ``(B, R)`` each. ``entropy``: None (not computed), ``"metric"``
        (detached, from the same log-softmax) or ``"loss"`` (with grad). A bare micro-batch is
        prefetched first."""
        if not isinstance(item, Prefetched):
            item = self._prefetch(item)
        mb = item.mb
        if isinstance(mb, PackedMicroBatch):
            return self._forward_packed(model, item, entropy)
        with self._replaying(model, mb):
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                           logits_to_keep=mb.logits_to_keep, use_cache=False).logits
        idx = mb.resp_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        z = logits.gather(1, idx).float()
        if item.scaled:  # skip a (B, R, V) pass in the common T = 1 case
            z = z / mb.temperature[:, :, None]
        if entropy is None:
            return log_probs_from_logits(z, mb.labels), None
        return log_probs_and_entropy(z, mb.labels, entropy_grad=entropy == "loss")

    def _forward_packed(self, model, item: Prefetched, entropy: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed row through the model, its LM head answering the scored tokens' log-probs
        in chunks (``trainer_daemon.compute.logprob_head``); results placed in the ``(B, R)`` layout.
        The attention mask was built once per micro-batch by :meth:`_prefetch` (policy, anchor,
        reference and epochs share it: every model of a step has the same attention
        implementation, checked here)."""
        mb = item.mb
        b, r = mb.response_shape
        if model.config._attn_implementation != self.model.config._attn_implementation:
            raise ValueError(f"{model.config._attn_implementation} for a micro-batch packed for {self.model.config._attn_implementation}")
        bounds = ({"cu_seq_lens_q": cu_seq_lens(mb.seq_lens, self.ctx.device)}
                  if model.config._attn_implementation == SEGMENTED else {})
        temps = mb.temperature if item.scaled else None  # known on the host: no device read
        with log_prob_head(model, mb.labels, temps, self.s.actor.log_prob_chunk_tokens, entropy), self._replaying(model, mb):
            out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=item.attn,
                        logits_to_keep=mb.score_pos, use_cache=False, **bounds).logits[0]
        zeros = out.new_zeros(b * r)
        logp = zeros.scatter(0, mb.flat_index, out[:, 0]).view(b, r)
        ent = zeros.scatter(0, mb.flat_index, out[:, 1]).view(b, r) if entropy is not None else None
        return logp, ent

    @torch.no_grad()
    def _log_probs(self, model, item: Prefetched | MicroBatch | PackedMicroBatch) -> torch.Tensor:
        return self._forward(model, item, None)[0].detach()

    # -- planning --------------------------------------------------------------------------
    def _plans(self, trajs: Sequence[Trajectory], groups: Sequence[Sequence[int]], keep: list[bool]) -> list[tuple[list[int], list[list[int]]]]:
        """Per mini-batch: all its members, and this rank's micro-batches ([] = dummy)."""
        out = []
        mini = self.s.actor.ppo_mini_batch_size
        for start in range(0, len(groups), mini):
            members = [i for g in groups[start:start + mini] for i in g if keep[i]]
            if not members:
                continue
            actor = self.s.actor
            plan = plan_mini_batch([len(trajs[i].token_ids) for i in members], [trajs[i].group_id for i in members],
                                   self.ctx.world_size, actor.ppo_micro_batch_size_per_gpu,
                                   token_budget=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None)
            out.append((members, [[members[j] for j in micro] for micro in plan[self.ctx.rank]]))
        return out

    # -- the step --------------------------------------------------------------------------
    def run(self, trajs: Sequence[Trajectory], groups: Sequence[Sequence[int]],
            weights: Sequence[float] | None = None) -> dict[str, float]:
        """Train on ``trajs`` (``groups``: indices per sample, in batch order); returns metrics.
        ``weights`` (per trajectory, default 1) scale each trajectory's advantage after the
        group baseline: the staleness down-weighting of ``algo.StalenessBound``."""
        t0 = time.perf_counter()
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
        gids = [t.group_id for t in trajs]
        adv = outcome_advantages(rewards, gids, self.s.actor.adv_estimator, norm_by_std=self.s.actor.norm_adv_by_std_in_grpo).tolist()
        stale_weights = list(weights) if weights is not None else []
        if stale_weights:
            if len(stale_weights) != len(trajs):
                raise ValueError(f"{len(stale_weights)} weights for {len(trajs)} trajectories")
            adv = [a * w for a, w in zip(adv, stale_weights, strict=True)]
        keep = [True] * len(trajs)
        if self.s.actor.filter_zero_variance_groups:
            keep = (~zero_variance_mask(rewards, gids)).tolist()
        plans = self._plans(trajs, groups, keep)
        # Micro-batches in plan order: every rank runs the same number of forward passes of
        # each (sharded) model, dummies included.
        build = pack if self.s.actor.use_remove_padding else collate
        mbs = [[self._prefetch(build(trajs, micro, adv, self.s.pad_id)) for micro in plan] for _, plan in plans]

        t1 = time.perf_counter()
        anchors = [[self._log_probs(self.model, mb) for mb in row] for row in mbs] if self.s.async_training.recomputes_log_probs else None
        t2 = time.perf_counter()
        refs = [[self._log_probs(self.reference, mb) for mb in row] for row in mbs] if self.s.actor.use_kl_loss else None
        t3 = time.perf_counter()

        sums: dict[str, float] = defaultdict(float)
        weights: dict[str, float] = defaultdict(float)
        grad_norms, skipped = [], 0
        for _ in range(self.s.actor.ppo_epochs):
            for p, (members, _) in enumerate(plans):
                tokens = float(sum(sum(trajs[i].loss_mask) for i in members))
                seqs = float(sum(1 for i in members if any(trajs[i].loss_mask)))
                for m, mb in enumerate(mbs[p]):
                    self._micro(mb, anchors[p][m] if anchors else None, refs[p][m] if refs else None,
                                tokens, seqs, sums, weights)
                norm = self._clip()
                grad_norms.append(norm)
                if math.isfinite(norm):
                    self.optimizer.step()
                else:
                    skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
        t4 = time.perf_counter()
        metrics = self._reduce(sums, weights, max(1, len(grad_norms)))
        tokens = sum(len(t.token_ids) for t in trajs)
        resp = [t.response_length for t in trajs]
        elapsed = time.perf_counter() - t0
        finite = [g for g in grad_norms if math.isfinite(g)]
        metrics.update({
            "actor/grad_norm": sum(finite) / len(finite) if finite else 0.0,
            "actor/lr": float(self.optimizer.param_groups[0]["lr"]),
            "actor/num_updates": float(len(grad_norms)),
            "actor/skipped_updates": float(skipped),
            "critic/rewards/mean": float(rewards.mean()) if len(trajs) else 0.0,
            "critic/rewards/max": float(rewards.max()) if len(trajs) else 0.0,
            "critic/rewards/min": float(rewards.min()) if len(trajs) else 0.0,
            "response_length/mean": sum(resp) / max(1, len(resp)),
            "response_length/max": float(max(resp, default=0)),
            "response_length/min": float(min(resp, default=0)),
            "trainer/zero_variance_filtered": float(keep.count(False)),
            "fully_async/staleness/downweighted_trajectories": float(sum(w < 1.0 for w in stale_weights)),
            "fully_async/staleness/weight_mean": sum(stale_weights) / len(stale_weights) if stale_weights else 1.0,
            "trainer/trajectories": float(len(trajs)),
            "trainer/samples": float(len(groups)),
            "perf/total_num_tokens": float(tokens),
            "perf/throughput": tokens * self.s.actor.ppo_epochs / elapsed / self.ctx.world_size,
            "timing_s/old_log_prob": t2 - t1,
            "timing_s/ref": t3 - t2,
            "timing_s/update_actor": t4 - t3,
        })
        if (replay := self.replays.get(id(self.model))) is not None:
            flips, routed = replay.take_counts()
            metrics["actor/router_replay/flip_rate"] = flips / routed if routed else 0.0
        return metrics

    def _micro(self, item: Prefetched, anchor, ref, tokens: float, seqs: float, sums, weights) -> None:
        """Forward, loss, backward of one micro-batch. A dummy has an all-zero mask: its loss is
        exactly 0 with zero gradients, but the passes (and FSDP's collectives) still happen."""
        with self._replaying(self.model, item.mb):  # the backward's recompute replays the same routes
            self._micro_passes(item, anchor, ref, tokens, seqs, sums, weights)

    def _micro_passes(self, item: Prefetched, anchor, ref, tokens: float, seqs: float, sums, weights) -> None:
        actor = self.s.actor
        mb = item.mb
        logp, ent = self._forward(self.model, item, "loss" if actor.entropy_coeff != 0.0 else
                                  "metric" if actor.calculate_entropy else None)
        dev = logp.device
        old, behav = resolve_log_probs(self.s.async_training, mb.rollout_logp.to(dev), None if anchor is None else anchor.to(dev))
        loss, m = compute_actor_loss(
            logp, old, mb.advantages.to(dev), mb.mask.to(dev), self.s.actor, rollout_log_prob=behav, entropy=ent,
            ref_log_prob=None if ref is None else ref.to(dev), global_tokens=tokens, global_seqs=seqs,
            dp_size=self.ctx.world_size, metrics_on_device=True,
        )
        loss.backward()
        w = item.mass  # read on the host before the loop: no device synchronisation
        for k, v in m.items():
            if k in SHARE_METRICS:
                sums[k] += v
            else:
                sums[k] += v * w
                weights[k] += w

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(params, self.s.actor.optim.grad_clip)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm.item())

    def _reduce(self, sums: dict[str, float], weights: dict[str, float], n_updates: int) -> dict[str, float]:
        """Loss shares: summed per update, averaged over ranks and updates; the rest: token-weighted
        means over micro-batches and ranks (for ``*_max``/``*_min`` that is a mean of extremes)."""
        keys = sorted(set(sums) | set(weights))  # identical on every rank: dummies report every key
        # the micro-batches' metrics stayed on the device: one transfer for the whole step
        vec = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float64, device=self.ctx.device) for k in keys]
                          ).cpu().tolist() if keys else []
        vec += [weights.get(k, 0.0) for k in keys]
        if self.ctx.world_size > 1 and vec:
            t = torch.tensor(vec, dtype=torch.float64)
            dist.all_reduce(t, group=self.ctx.cpu_group)
            vec = t.tolist()
        n = len(keys)
        out = {}
        for j, k in enumerate(keys):
            if k in SHARE_METRICS:
                out[k] = vec[j] / self.ctx.world_size / n_updates
            else:
                out[k] = vec[j] / vec[n + j] if vec[n + j] > 0 else 0.0
        return out
