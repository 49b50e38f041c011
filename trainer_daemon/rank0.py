"""Everything only trainer rank 0 does: the I/O loop, the NATS connection and stream consumer,
metrics sinks, and the weight-sync controller — behind synchronous methods the training loop
calls between steps.

Every call into the I/O loop is bounded (``IO_TIMEOUT_S`` beyond the operation's own wait).
``close()`` releases everything in reverse order and never raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.config import secret
from asyncrl.jetstream import StreamSettings, connect, ensure_stream, resolve_nats_url
from asyncrl.wire import NatsNames, Trajectory
from trainer_daemon.algo import StalenessBound
from trainer_daemon.consume import ConsumptionState, PendingGroup, TrajectorySource
from trainer_daemon.consume.exclusion import excluder
from trainer_daemon.io_loop import IoLoop
from trainer_daemon.observe.metrics import MetricsHub
from trainer_daemon.observe.tracking import build_tracking_sinks
from trainer_daemon.state.ledger import (
    JOURNAL,
    LEDGER_DIR,
    Ledger,
    clear_finished,
    lost_steps,
    read_finished,
)
from trainer_daemon.state.lineage import Lineage
from trainer_daemon.sync import SyncController, build_publisher

log = logging.getLogger(__name__)

PUSH_CHECK_S = 5.0  # an idle trainer asks the sync agent this often whether engines wait for a full push
RETRY_CHECK_S = 0.5  # ... and this often after a failed sync, until one succeeds (engines may be left mixed)
AUDIT_S = 300.0  # the end's audit reads every message still stored, one request each
IO_TIMEOUT_S = 60.0  # slack on top of an I/O call's own wait: acks, purges, a JetStream API round trip
CONNECT_TIMEOUT_S = 60.0  # NATS port poll (10 s) + connect + stream setup on a busy machine
NATS_CLOSE_TIMEOUT_S = 10.0


class RunEndedUnaccounted(RuntimeError):
    """The checkpoint to resume is a finished run's whose end audit failed (ledger.py, "Finished")."""


class Rank0Services:
    """See the module docstring."""

    def __init__(self, cfg, trainer_state: dict[str, Any], admit: Callable[[Trajectory], str]) -> None:
        self.cfg = cfg
        self.names = NatsNames(cfg.run.id)
        self.io = IoLoop()
        self.nc = None
        self.metrics: MetricsHub | None = None
        self.sync: SyncController | None = None
        self._base_version = int(trainer_state.get("weight_version", 0))
        self.lineage = Lineage.from_state(trainer_state.get("version_jumps"))
        self.jumped = False
        """At start the engines were ahead of the restored version: it jumped past them."""
        self._push_checked = 0.0
        state = ConsumptionState()
        if trainer_state.get("consumption"):
            state.load_state_dict(trainer_state["consumption"])
        ckpts = Path(cfg.run_dir) / "checkpoints"
        marked = read_finished(ckpts)
        if marked and marked.get("problem") and trainer_state and int(marked["step"]) == int(trainer_state.get("step", -1)):
            raise RunEndedUnaccounted(f"the run ended at step {marked['step']} with the stream not accounted for: "
                                      f"{marked['problem']} (remove {ckpts / LEDGER_DIR / 'finished.json'} to start "
                                      "a trainer on it anyway)")
        clear_finished(ckpts)  # this trainer continues the run: it is not finished (ledger.py, "Finished")
        self.periodic_checkpoints = cfg.trainer.checkpoint.save_freq > 0
        journal = ckpts / LEDGER_DIR / JOURNAL  # also without checkpoints: `asyncrl audit` of a live run accounts by it
        ledger = Ledger(parent=trainer_state.get("step") if trainer_state else None, journal=journal, root=ckpts)
        lost = lost_steps(ckpts, int(trainer_state.get("step", 0)) if trainer_state else 0) if self.periodic_checkpoints else []
        if not self.periodic_checkpoints and not trainer_state and journal.is_file():
            # without checkpoints the stream is purged at each commit: an earlier trainer's steps, and their data, are gone
            gone = [e["step"] for e in lost_steps(ckpts, 0)]
            log.warning("steps %s were trained by an earlier trainer of this run and lost with it (trainer.checkpoint."
                        "save_freq = 0: no checkpoint, their messages purged at each commit)", gone)
            journal.unlink()
        if lost:
            log.warning("steps %s were trained after the restored checkpoint and lost with a crash (%d trajectories); "
                        "recorded in the ledger, their data is trained again", [e["step"] for e in lost],
                        sum(len(e.get("trained", [])) for e in lost))
        ledger.adopt_lost(lost)
        required = cfg.derived.required_samples * cfg.rollout.n
        self.source = TrajectorySource(self.names, state, ledger, required, ack_wait_s=cfg.trainer.ack_wait_s,
                                       in_flight=cfg.derived.max_concurrent_samples, dead_letters_keep=cfg.nats.dead_letters_keep,
                                       effective=self.lineage.effective, exclude=excluder(cfg.actor.truncated_sampling),
                                       admit=admit)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        url = resolve_nats_url(cfg.nats.url, cfg.run_dir)
        password = secret(cfg.security.nats_password)

        async def _start():
            self.nc = await connect(url, f"trainer-{cfg.run.id}", user=cfg.nats.user, password=password)
            js = self.nc.jetstream()
            await ensure_stream(js, StreamSettings.of(cfg))
            await self.source.start(js)
            asyncio.get_running_loop().create_task(self.source.heartbeat_loop(cfg.trainer.ack_wait_s / 4), name="heartbeats")

        self.io.run(_start(), CONNECT_TIMEOUT_S)
        t = cfg.trainer
        self.metrics = MetricsHub(cfg.run_dir, list(t.loggers), t.metrics_host, t.metrics_listen_port, send=self._send_metrics,
                                  extra_sinks=build_tracking_sinks(cfg))
        publisher = build_publisher(cfg)
        if publisher is not None:
            self.sync = SyncController(publisher, self.io, self._base_version, self.lineage)
            self.jumped = self.sync.adopt(self._engines_version())
        self.metrics.live("trainer/weight_version", self.version)

    @property
    def sync_failed(self) -> bool:
        """The last sync failed: engines it left mixed may wait for a push (asked every ``RETRY_CHECK_S``)."""
        return self.sync is not None and self.sync.last_failed

    def data_wait_s(self, idle_s: float) -> float:
        """How long to wait for a batch: ``idle_s``, or only ``RETRY_CHECK_S`` while a sync is in
        flight or after a failed one, so that a failure is seen, and the push the engines then
        wait for is made, without waiting out the idle poll (issue 33)."""
        busy = self.sync is not None and (self.sync.in_flight or self.sync.last_failed)
        return min(idle_s, RETRY_CHECK_S) if busy else idle_s

    def push_wanted(self) -> bool:
        """Engines wait for a full push (bounded; asked at most every ``PUSH_CHECK_S``, or
        ``RETRY_CHECK_S`` after a failed sync; never while a sync is in flight)."""
        now = time.monotonic()
        every = RETRY_CHECK_S if self.sync_failed else PUSH_CHECK_S
        if self.sync is None or self.sync.in_flight or now - self._push_checked < every:
            return False
        self._push_checked = now
        try:
            return bool(self.io.run(self.sync.publisher.push_wanted(), IO_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - asked again later
            log.warning("asking whether engines wait for a push: %s", exc)
            return False

    def _engines_version(self) -> int | None:
        """What the engines serve now (bounded; None when nobody answers)."""
        try:
            return self.io.run(self.sync.publisher.current_version(), IO_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - unknown: the first sync's answer will tell ("stale")
            log.warning("could not ask for the engines' weight version: %s", exc)
            return None

    def _send_metrics(self, payload: bytes) -> None:
        subject = self.names.metrics("trainer")

        async def _pub():
            try:
                await self.nc.publish(subject, payload)
            except Exception as exc:  # noqa: BLE001 - best effort by contract
                log.debug("metrics publish failed: %s", exc)

        self.io.loop.call_soon_threadsafe(lambda: self.io.loop.create_task(_pub()))

    def close(self) -> None:
        steps = [
            ("sync", lambda: self.sync is not None and self.io.run(self.sync.publisher.close(), IO_TIMEOUT_S)),
            ("source", lambda: self.io.run(self.source.close(), IO_TIMEOUT_S)),
            ("nats", lambda: self.nc is not None and self.io.run(self.nc.close(), NATS_CLOSE_TIMEOUT_S)),
            ("io", self.io.close),
            ("metrics", lambda: self.metrics is not None and self.metrics.close()),
        ]
        for name, fn in steps:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - close everything else regardless
                log.warning("closing %s failed: %s", name, exc)

    # -- data ------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.sync.version if self.sync is not None else self._base_version

    def next_batch(self, k: int, bound: StalenessBound, wait_s: float) -> list[PendingGroup] | None:
        return self.io.run(self.source.next_batch(k, self.version, bound, wait_s), wait_s + IO_TIMEOUT_S)

    @property
    def data_ended(self) -> bool:
        """The rollout published its end of data and it was read (``source.data_ended``)."""
        return self.source.data_ended

    def audit_the_end(self) -> str | None:
        """At a finished run's end (its final checkpoint complete, ``finished.json`` written):
        ``asyncrl audit``'s reconciliation of the stream with the ledger; what it found wrong
        (the unconsumed ids first), or None. A finish is declared only when every message the
        rollout published is trained or dropped with a reason (issue 65)."""
        from trainer_daemon.audit import SHOW, audit_run

        try:
            cfg = self.cfg
            audit = self.io.run(audit_run(Path(cfg.run_dir), resolve_nats_url(cfg.nats.url, cfg.run_dir), cfg.run.id,
                                          user=cfg.nats.user, password=secret(cfg.security.nats_password)), AUDIT_S)
        except Exception as exc:  # noqa: BLE001 - the run ended; the operator can run `asyncrl audit`
            log.warning("could not audit the run's end (%s): run `asyncrl audit %s`", exc, self.cfg.run_dir)
            return None
        if audit.ok:
            log.info("the run's end audited: %d published, %d trained, %d dropped, nothing lost, twice or left",
                     audit.published, audit.trained, audit.dropped)
            return None
        return (f"{audit.unconsumed_at_end} unconsumed at the end (first {SHOW}: {audit.unconsumed_ids}), "
                f"{audit.lost} lost (sequences {audit.lost_seqs}), {audit.twice} trained twice ({audit.twice_ids}), "
                f"{audit.lost_after_ack} lost after their acknowledgement ({audit.lost_after_ack_ids})")

    @property
    def unsaved_resolutions(self) -> bool:
        """Messages were resolved since the last checkpoint (``Ledger.unsaved``)."""
        return self.source.ledger.unsaved

    def take_rest(self, bound: StalenessBound) -> list[PendingGroup]:
        """The groups left after the end of data (``source.take_rest``)."""

        return self.io.run(self.source.take_rest(self.version, bound), IO_TIMEOUT_S)

    def commit(self, groups: list[PendingGroup], step: int) -> dict[str, float]:
        """Resolve, ack and record a trained step. Without periodic checkpoints
        (``save_freq = 0``) there is no checkpoint to resume from, so the stream is purged
        through the committed cursor at once (else checkpoints purge it: ``checkpointed``);
        either way the stream holds only what may still be trained, at any run length."""
        metrics = self.io.run(self.source.commit(groups, step, self.version), IO_TIMEOUT_S)
        if not self.periodic_checkpoints:
            self.io.run(self.source.purge_through(self.source.state.cursor), IO_TIMEOUT_S)
        metrics.update(self.io.run(self.source.lag(), IO_TIMEOUT_S))
        c = self.source.state.counters
        metrics.update({
            "trainer/dropped_stale_trajectories": float(c["dropped"]),
            "trainer/dropped_stale_tokens": float(c.get("dropped_tokens", 0)),
            "trainer/poison_messages": float(c["poison"]),
            "trainer/duplicate_trajectories": float(c["duplicate"]),
            "trainer/incomplete_groups": float(c["incomplete_groups"]),
            "trainer/trained_trajectories": float(c["trained"]),
            "trainer/excluded_trajectories": float(c.get("excluded", 0)),
            **{f"trainer/excluded_trajectories/{k.removeprefix('excluded/')}": float(v)
               for k, v in c.items() if k.startswith("excluded/")},
            "trainer/truncated_sampling_trajectories": float(c.get("truncated_sampling_trained", 0)),
            "trainer/stream_cursor": float(self.source.state.cursor),
            "trainer/redelivered_messages": float(self.source.redelivered_skipped + self.source.redelivered_held),
            "trainer/consumer_resyncs": float(self.source.resyncs),
        })
        return metrics

    def snapshot(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(consumption state, ledger segment)`` for a checkpoint at ``step``."""

        async def _snap():
            return self.source.state.state_dict(), self.source.ledger.snapshot(step, self.version)

        return self.io.run(_snap(), IO_TIMEOUT_S)

    def checkpointed(self, step: int, oldest_kept_cursor: int, purge: bool = True) -> None:
        """Checkpoint ``step`` is complete: trim the ledger's journal, purge the stream up to the
        oldest kept checkpoint's cursor (``purge``; skipped by a signalled stop, which NATS may
        share: the next checkpoint purges as far)."""
        self.source.ledger.trim_journal(step)
        if purge:
            self.io.run(self.source.purge_through(oldest_kept_cursor), IO_TIMEOUT_S)

    # -- weights ---------------------------------------------------------------------------
    def poll_sync(self) -> dict[str, float]:
        """Metrics of a sync that finished since the last call ({} if none)."""
        if self.sync is None:
            return {}
        self.sync.poll()
        if not self.sync.fresh:
            return {}
        self.sync.fresh = False
        self.metrics.live("trainer/weight_version", self.version)
        return dict(self.sync.last)


def metrics_endpoint(run_dir: Path) -> str | None:
    """The URL rank 0 serves Prometheus metrics on, once it is up (tests, ``asyncrl up``)."""
    p = Path(run_dir) / "metrics" / "trainer_endpoint"
    return p.read_text().strip() if p.is_file() else None
