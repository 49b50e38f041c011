"""The trainer daemon's main loop (every rank runs it; rank 0 decides, the others follow).

Each iteration rank 0 produces a *command* and broadcasts it to all ranks (msgpack bytes):
``train`` with the step batch (the wire bytes of whole groups, in order), ``idle`` when no
batch arrived within ``IDLE_POLL_S`` (so no rank blocks in a collective for longer than that),
``push`` (idle, and the sync agent says engines wait for a full push of the weights: every
engine may be quarantined, so no data would ever come — publish now), or ``stop``
(``trainer.total_training_steps`` reached, the rollout's end of data read with every
trajectory before it resolved — :mod:`asyncrl.wire.end_of_data` —, or SIGTERM/SIGINT). After
the end of data, groups too few for a whole step are trained as a last, smaller step (verl's
trainer does the same with the samples it holds at the end signal), so a finite run ends with
every published trajectory trained or dropped with a counted reason. Then, on every rank:

1. the step (``TrainStep``) — all ranks decode the same batch;
2. rank 0 commits it: messages resolved and acked, ledger entry, verl's ``fully_async/*``;
3. every ``async_training.trigger_parameter_sync_step`` steps, if a publisher is configured:
   the weights are snapshotted on rank 0 (collective: the full state dict on the host, or the
   packed buckets on the weight group's device, ``sync.staging``) and published in the
   background — training continues at once; a sync still in flight at the next sync point is waited for
   (bounded by the sync timeouts; if it still runs, that sync point is skipped and counted);
4. every ``trainer.checkpoint.save_freq`` steps, and at the end: a checkpoint (collective);
5. rank 0 emits the step's metrics.

Weight version: the checkpoint's (0 fresh), +1 per successful publish. After a resume the
restored weights are re-published first, since engines may hold newer weights from the lost
steps (RELIABILITY.md §2): under the same version when the engines are not ahead, else as the
engines' version + 1 (versions never go back; ``trainer_daemon.state.lineage`` keeps lags counting
training steps across the jump).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import msgspec
import torch

from asyncrl import failpoints
from asyncrl.models import load_tokenizer
from asyncrl.models.checkpoint_layout import CheckpointLayout
from asyncrl.models.cuda_attention import avoid_cudnn_attention
from asyncrl.wire import decode_trajectory
from trainer_daemon.algo import StalenessBound
from trainer_daemon.compute.step import StepSettings, TrainStep
from trainer_daemon.consume.admission import PolicyRouting, admission_check
from trainer_daemon.policy.distributed import PROCESS_GROUP_TIMEOUT_S, init_distributed
from trainer_daemon.policy.lora import adapter_snapshot
from trainer_daemon.policy.model import (
    attention_for,
    build_optimizer,
    build_policy,
    build_reference,
    build_scheduler,
    engine_weights,
    full_state_dict,
    policy_vocab_size,
)
from trainer_daemon.state.checkpoint import CheckpointManager
from trainer_daemon.state.export import export_hf
from trainer_daemon.state.ledger import write_finished
from trainer_daemon.sync import staging_device, staging_mode, weight_sync_backend
from trainer_daemon.sync.staging import WeightStager, engine_layout, engine_tensors

log = logging.getLogger(__name__)

IDLE_POLL_S = 2.0  # longest rank 0 waits for data before telling the other ranks "idle" (and refreshing the idle gauge)
PG_TIMEOUT_SLACK_S = 60.0  # a collective may wait for rank 0 to finish waiting for a sync


class Command(msgspec.Struct):
    kind: str  # "train" | "idle" | "push" | "stop"
    payloads: list[bytes] = []
    groups: list[list[int]] = []
    weights: list[float] = []
    """Per payload: the staleness weight of its advantage (``PendingGroup.weights``)."""
    save: bool = False
    """``stop`` only: record in the current step's checkpoint, though it was saved, what was
    resolved since (a stale group dropped after the last step; issue 65): ``Checkpointer.amend``."""


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Command)


class TrainerDaemon:
    """See the module docstring. ``setup()``, ``run()``, then always ``close()``."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.ctx = None
        self.r0 = None
        self.step = 0
        self.stop_requested = False
        self.stop_deadline: float | None = None
        """Monotonic time by which a signalled stop must have checkpointed (``trainer.stop_timeout_s``)."""
        self._last_saved = -1
        self._save_again = False  # the stop command's ``save``
        self.exit_code = 0
        """1 when the run ended with stream messages neither trained nor dropped (``_finish``)."""
        self._publishing: tuple[int, int] | None = None  # (step, target version) of the last sync started
        self._idle_s = 0.0
        self._finished: str | None = None  # why the run ended (ledger.FINISH_REASONS); None: stopped, not ended
        self._window_start = time.perf_counter()
        self._wait_started: float | None = None
        self._pending: list | None = None
        self._sync_metrics: dict[str, float] = {}
        self.sync_skipped = 0
        self._stager: WeightStager | None = None
        self._staging: str | None = None  # sync.staging, resolved at the first sync
        self._layout: CheckpointLayout | None = None  # the engines' names (engine_layout), built at the first use

    # -- setup -----------------------------------------------------------------------------
    def _sync_wait_s(self) -> float:
        s = self.cfg.sync
        return s.group_init_timeout_s + s.pause_timeout_s + s.broadcast_timeout_s + s.resume_timeout_s

    def _engine_layout(self, tied: bool) -> CheckpointLayout:
        if self._layout is None:
            self._layout = engine_layout(self.model, tied)
        return self._layout

    @property
    def _lora_scaling(self) -> float | None:
        """``lora_alpha / lora_rank`` with LoRA adapters (merged into what the engines get), else None."""
        a = self.cfg.actor
        return a.lora_alpha / a.lora_rank if a.lora_rank else None

    def _stop_cutoff(self) -> float | None:
        """After a signal: when rank 0 stops waiting for a sync, leaving a quarter of
        ``trainer.stop_timeout_s`` to the checkpoint (read during the wait, so a signal that
        comes while it waits shortens it); None before."""
        if self.stop_deadline is None:
            return None
        return self.stop_deadline - self.cfg.trainer.stop_timeout_s / 4

    def setup(self) -> None:
        cfg, t = self.cfg, self.cfg.trainer
        self.ctx = init_distributed(t.device, max(PROCESS_GROUP_TIMEOUT_S, self._sync_wait_s() + PG_TIMEOUT_SLACK_S))
        avoid_cudnn_attention(self.ctx.device)
        torch.manual_seed(cfg.model.seed)
        tok = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        dev, ws = self.ctx.device, self.ctx.world_size
        attn = attention_for(cfg.actor.attn_implementation, dev, cfg.actor.use_remove_padding)
        a = cfg.actor
        self.model = build_policy(cfg.model.path, cfg.model.seed, dev, ws, t.mixed_precision, a.activation_checkpointing,
                                  a.use_torch_compile, attn, (a.lora_rank, a.lora_alpha, a.target_modules) if a.lora_rank else None)
        reference = build_reference(cfg.model.path, cfg.model.seed, dev, ws, t.mixed_precision, attn) if cfg.actor.use_kl_loss else None
        self.optimizer = build_optimizer(self.model, cfg.actor.optim)
        self.total_steps = t.total_training_steps or cfg.derived.total_updates
        per_step = cfg.async_training.require_batches * cfg.actor.ppo_epochs
        self.scheduler = build_scheduler(self.optimizer, cfg.actor.optim, self.total_steps and self.total_steps * per_step)
        self.step_fn = TrainStep(self.model, self.optimizer, self.scheduler, StepSettings.from_config(cfg, pad_id), self.ctx, reference)
        self.ckpt = CheckpointManager(cfg.run_dir / "checkpoints", self.ctx, t.checkpoint.keep_last, t.checkpoint.async_save)
        state = self._resume()
        self.step = self._last_saved = int(state.get("step", 0))
        self.staleness = StalenessBound.from_config(cfg.async_training)
        self.has_sync = bool(cfg.sync.url or cfg.engines.urls)
        republish = None
        if self.ctx.is_rank0:
            from trainer_daemon.rank0 import Rank0Services

            routing = PolicyRouting.of(self.model.config, cfg.actor.router_replay.mode == "R3")
            self.r0 = Rank0Services(cfg, state, admission_check(cfg.run.id, policy_vocab_size(self.model), cfg.model.max_model_len,
                                                                routing))
            self.r0.start()
            republish = b"1" if int(state.get("weight_version", 0)) > 0 or self.r0.jumped else b"0"
        if self.has_sync and self.ctx.broadcast_bytes(republish) == b"1":
            self._publish(same_version=True)
        self._window_start = time.perf_counter()
        log.info("trainer ready at step %d (world size %d)", self.step, self.ctx.world_size)

    def _resume(self) -> dict[str, Any]:
        path = None
        if self.ctx.is_rank0:
            self.ckpt.clean()
            latest = self.ckpt.latest()
            if latest is not None and not self.cfg.trainer.checkpoint.resume:
                raise RuntimeError(f"checkpoints exist in {latest.parent}; delete them or set trainer.checkpoint.resume=true")
            path = str(latest) if latest is not None else ""
        path = self.ctx.broadcast_bytes(path.encode() if path is not None else None).decode()
        if not path:
            return {}
        state = self.ckpt.load(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        log.info("resumed from %s (step %d, weight version %d)", path, state["step"], state.get("weight_version", 0))
        return state

    # -- loop ------------------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        """SIGTERM/SIGINT: stop after the current step, checkpointed within ``trainer.stop_timeout_s``."""
        self.stop_requested = True
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.cfg.trainer.stop_timeout_s

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)

    def _next_command(self) -> Command:
        if self.ctx.is_rank0:
            cmd = self._decide()
            return _dec.decode(self.ctx.broadcast_bytes(_enc.encode(cmd)))
        return _dec.decode(self.ctx.broadcast_bytes(None))

    def _decide(self) -> Command:
        self._background()
        if self.stop_requested or (self.total_steps and self.step >= self.total_steps):
            self._finished = None if self.stop_requested else "total_steps"
            return Command("stop")
        if self.r0.sync_failed and self.r0.push_wanted():
            return Command("push")  # a failed sync left engines waiting for weights: before the next batch
        k = self.cfg.derived.required_samples
        t0 = time.perf_counter()
        self._wait_started = self._wait_started or t0
        groups = self.r0.next_batch(k, self.staleness, self.r0.data_wait_s(IDLE_POLL_S))
        now = time.perf_counter()
        self._idle_s += now - t0
        self.r0.metrics.live("trainer/waiting_for_data_s", 0.0 if groups else now - self._wait_started)
        if groups is None and self.r0.data_ended:
            groups = self.r0.take_rest(self.staleness) or None
            if groups is None:
                log.info("the rollout's data ended and every trajectory is resolved: stopping at step %d", self.step)
                self._finished = "data_ended"
                return Command("stop", save=self.r0.unsaved_resolutions)
            log.info("the rollout's data ended: training the %d groups left (%d trajectories) as a last, smaller step",
                     len(groups), sum(len(g.kept) for g in groups))
        if groups is None:
            return Command("push") if self.r0.push_wanted() else Command("idle")
        self._wait_started = None
        self._pending = groups
        payloads, index, weights = [], [], []
        for g in groups:
            index.append(list(range(len(payloads), len(payloads) + len(g.kept))))
            payloads.extend(h.payload for h in g.kept)
            weights.extend(g.weights.get(h.traj.id, 1.0) for h in g.kept)
        return Command("train", payloads, index, weights)

    def _background(self) -> None:
        """Rank 0 between steps: record a finished sync, finalise an async checkpoint, purge."""
        self._sync_metrics.update(self.r0.poll_sync())
        done = self.ckpt.poll()
        if done is not None:
            self.r0.checkpointed(done, self.ckpt.oldest_kept_cursor(), purge=self.stop_deadline is None)

    def run(self) -> None:
        t = self.cfg.trainer
        trigger = self.cfg.async_training.trigger_parameter_sync_step
        while True:
            cmd = self._next_command()
            if cmd.kind == "stop":
                self._save_again = cmd.save
                break
            if cmd.kind == "idle":
                continue
            if cmd.kind == "push":  # engines wait for the weights; no step to wait for
                self._publish()
                continue
            failpoints.hold(f"trainer.step.{self.step + 1}")  # fault tests: the step's batch is taken, not trained
            trajs = [decode_trajectory(p) for p in cmd.payloads]
            t0 = time.perf_counter()
            metrics = self.step_fn.run(trajs, cmd.groups, cmd.weights or None)
            floor = t.step_time_floor_s - (time.perf_counter() - t0)
            if floor > 0:  # benchmarks: emulate a bigger model's step (bench/modes.py)
                time.sleep(floor)
            train_s = time.perf_counter() - t0
            self.step += 1
            if self.ctx.is_rank0:
                metrics.update(self.r0.commit(self._pending, self.step))
                self._pending = None
            full = self._publish() if self.has_sync and self.step % trigger == 0 else None
            if t.checkpoint.save_freq and self.step % t.checkpoint.save_freq == 0:
                self._save(full)
            if self.ctx.is_rank0:
                self._emit(metrics, train_s)
        self._finish()

    def _emit(self, metrics: dict[str, float], train_s: float) -> None:
        now = time.perf_counter()
        window = max(now - self._window_start, 1e-9)
        metrics.update(self._sync_metrics)
        self._sync_metrics = {}
        if self.r0.sync is not None:
            metrics["trainer/sync_failures"] = float(self.r0.sync.failures)
            metrics["trainer/sync_successes"] = float(self.r0.sync.successes)
        metrics.update({
            "trainer/idle_ratio": min(1.0, self._idle_s / window),
            "trainer/idle_time_s": self._idle_s,
            "timing_s/step": window,
            "timing_s/train": train_s,
            "trainer/tokens_per_s": metrics.get("perf/total_num_tokens", 0.0) * self.cfg.actor.ppo_epochs / max(train_s, 1e-9),
            "trainer/weight_version": float(self.r0.version),
            "trainer/global_step": float(self.step),
        })
        metrics.setdefault("fully_async/count/current_param_version", float(self.r0.version))
        self.r0.metrics.emit(self.step, metrics)
        self._idle_s, self._window_start = 0.0, now

    # -- sync and checkpoints --------------------------------------------------------------
    def _publish(self, same_version: bool = False) -> dict[str, torch.Tensor] | None:
        """*Collective.* Snapshot the weights (``sync.staging``: the full state dict on the
        host, returned for a checkpoint's export, or the packed buckets on the weight group's
        device, :mod:`trainer_daemon.sync.staging`); rank 0 starts publishing them once the
        previous publish has ended (bounded; else this sync point is skipped)."""
        sender = self.ctx.is_rank0 and self.r0.sync is not None
        finished = True
        if sender:
            finished = self.r0.sync.wait(self._sync_wait_s(), self._stop_cutoff)
            self._sync_metrics.update(self.r0.poll_sync())
            if not finished:
                self.sync_skipped += 1
                self._sync_metrics["trainer/sync_skipped"] = float(self.sync_skipped)
                log.error("skipping the weight sync at step %d: the previous one is still running", self.step)
        dtype = getattr(torch, self.cfg.model.dtype)
        if self.cfg.syncs_adapters:  # the adapter alone (every rank: the gather of the trainable parameters)
            snapshot = adapter_snapshot(self.model, self.cfg.actor, self.cfg.model.path, dtype, write=sender and finished)
            if snapshot is not None:
                target = self.r0.sync.start(snapshot, version=self.r0.version if same_version else None)
                self._publishing = (self.step, target)
            return None
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        full = None
        mode = self._staging_mode(tied, dtype)
        if self._stager is None and mode != "state_dict":
            self._stager = WeightStager(self.model, tied=tied, dtype=dtype, bucket_bytes=self.cfg.sync.bucket_bytes,
                                        device=staging_device(weight_sync_backend(self.cfg.trainer, self.cfg.engines)), is_sender=self.ctx.is_rank0,
                                        layout=self._engine_layout(tied))
        if mode == "two_buckets":
            self._stream(sender and finished, same_version)  # every rank: the gathers, while rank 0 publishes
            return None
        if self._stager is not None:
            weights = self._stager.capture(self.model, write=sender and finished)  # every rank: the gathers
        else:
            full = full_state_dict(self.model)
            weights = (self._engine_layout(tied).to_checkpoint(engine_weights(full, tied, dtype, self._lora_scaling))
                       if sender and finished else None)
        if weights is not None:
            target = self.r0.sync.start(weights, version=self.r0.version if same_version else None)
            self._publishing = (self.step, target)
        return full

    def _staging_mode(self, tied: bool, dtype: torch.dtype) -> str:
        """``sync.staging`` resolved once (``auto`` weighs the model's bytes against the GPU's)."""
        if self._staging is None:
            nbytes = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
                         for _, t in engine_tensors(self.model, tied))
            dev = self.ctx.device
            total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
            self._staging = staging_mode(self.cfg.sync, self.cfg.actor, weight_sync_backend(self.cfg.trainer, self.cfg.engines), nbytes, total)
            log.info("weight sync staging: %s (%.2f GB in %s)", self._staging, nbytes / 1e9, dtype)
        return self._staging

    def _stream(self, send: bool, same_version: bool) -> None:
        """*Collective.* ``sync.staging = two_buckets``: rank 0 (``send``) starts the publish of
        a bucket stream, then every rank walks the buckets; rank 0 packs each into a slot the
        publish has freed (trainer_daemon/sync/streaming.py). Returns when the last is packed."""
        stream = self._stager.open_stream(self._sync_wait_s()) if send else None
        if stream is not None:
            try:
                target = self.r0.sync.start(stream, version=self.r0.version if same_version else None)
            except BaseException:
                stream.close("the publish did not start", discard=True)
                raise
            self._publishing = (self.step, target)
        self._stager.stream(self.model, stream)

    def _save(self, full: dict[str, torch.Tensor] | None = None) -> None:
        """*Collective.* Checkpoint the current step (rank 0 adds the stream state and the ledger).
        ``full``: this step's gathered state dict, if a sync already gathered it."""
        ck = self.cfg.trainer.checkpoint
        export = None
        if ck.export_hf:
            full = full if full is not None else full_state_dict(self.model)
            layout = self._engine_layout(bool(getattr(self.model.config, "tie_word_embeddings", False)))
            export = lambda d: export_hf(d, full, self.model.config, self.cfg.actor, self.cfg.model, layout)  # noqa: E731
        state = segment = None
        if self.ctx.is_rank0:
            consumption, segment = self.r0.snapshot(self.step)
            state = {"step": self.step, "weight_version": self.r0.version, "version_jumps": self.r0.lineage.state_dict(),
                     "consumption": consumption,
                     "scheduler": self.scheduler.state_dict(), "world_size": self.ctx.world_size,
                     "time": time.time(), "model": self.cfg.model.path}
        label = None
        if self.ctx.is_rank0 and self._publishing is not None and self._publishing[0] == self.step:
            label = self._version_label(self._publishing[1])
        self.ckpt.save(self.step, self.model, self.optimizer, state, segment, export, label)
        self._last_saved = self.step
        if self.ctx.is_rank0 and not ck.async_save:
            self.r0.checkpointed(self.step, self.ckpt.oldest_kept_cursor(), purge=self.stop_deadline is None)

    def _version_label(self, target: int):
        """The checkpoint's weights are this step's, handed to the sync to ``target``: once that
        sync has ended (waited for, bounded, when the checkpoint is finalised) they are labelled
        ``weights_version = target`` and the version counter is ``target``; if it failed they
        were never published (``weights_version`` null, the counter unchanged)."""
        def label(state: dict[str, Any]) -> dict[str, Any]:
            ok = self.r0.sync.published(target, self._sync_wait_s(), self._stop_cutoff)
            if ok:
                return state | {"weight_version": max(int(state.get("weight_version", 0)), target), "weights_version": target}
            return state | {"weights_version": None, "weights_publish": "failed" if ok is False else f"pending {target}"}
        return label

    def _finish(self) -> None:
        """*Collective.* Wait for the last sync (so the final checkpoint records its version), save, settle."""
        if self.ctx.is_rank0 and self.r0.sync is not None and not self.r0.sync.wait(self._sync_wait_s(), self._stop_cutoff):
            log.error("exiting with a weight sync still running; the engines may be left paused or half-updated")
        amend = self.step == self._last_saved and self._save_again  # resolved after the step's checkpoint
        if self.step != self._last_saved:
            self._save()
        done = self.ckpt.wait()
        if self.ctx.is_rank0 and amend:  # the step's checkpoint amended (its weights unchanged), after its save ended
            self.ckpt.amend(self.step, *self.r0.snapshot(self.step))
            done = self.step
        if done is not None and self.ctx.is_rank0:
            self.r0.checkpointed(done, self.ckpt.oldest_kept_cursor(), purge=self.stop_deadline is None)
        if self.ctx.is_rank0 and self._finished:
            write_finished(self.cfg.run_dir / "checkpoints", self.step, self._finished)  # ledger.py, "Finished"
            problem = self.r0.audit_the_end()
            if problem and self._finished == "data_ended":  # the rollout said everything is published: all must be resolved
                log.error("the run ended at step %d with the stream not accounted for: %s", self.step, problem)
                write_finished(self.cfg.run_dir / "checkpoints", self.step, self._finished, problem)
                self.exit_code = 1
            elif problem:  # its total steps reached: what the rollout published beyond them is not trained, by design
                log.warning("the trainer reached its total steps (%d) with the stream not accounted for: %s", self.step, problem)
        log.info("trainer finished at step %d", self.step)

    def close(self) -> None:
        if self.r0 is not None:
            self.r0.close()
        if self.ctx is not None:
            self.ctx.destroy()
