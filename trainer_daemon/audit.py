"""``asyncrl audit RUN_DIR``: reconcile the trajectory stream against the trainer's ledger (I1).

    asyncrl audit runs/demo [--nats nats://127.0.0.1:4222] [--run-id demo] [--json]

Reads the lineage of the newest complete checkpoint (``trainer_daemon.state.ledger``: per step, the
ids and stream sequences trained, dropped as stale, skipped as duplicates, terminated as poison,
and the sequences of the dead-letter copies) and every message still in the run's stream, then
classifies every stream sequence from 1 to the last:

- ``trained`` / ``dropped`` / ``duplicate`` / ``poison``: accounted for by the ledger;
- ``dlq``: a dead-letter copy the trainer published (ledger, or the dead-letter subject);
- ``end``: the rollout's end-of-data message, read by the trainer or still stored (a trainer
  that stopped at its total steps need not read it);
- ``pending``: still in the stream, not yet accounted for along the checkpoint lineage (trained
  after the last checkpoint, or not yet consumed);
- ``since_checkpoint``: gone from the stream, committed after the newest complete checkpoint
  (the ledger's journal: a live trainer's steps since it; with ``save_freq = 0`` every purged
  message until the final checkpoint);
- ``lost``: gone from the stream (purged or expired) without being accounted for — a violation;
- ``twice``: trajectory ids trained more than once along the lineage — a violation;
- ``unconsumed_at_end``: of a *finished* run (the trainer recorded that it ended at this
  checkpoint: ``trainer_daemon.state.ledger``, "Finished"), the trajectories still pending — published
  before the rollout's end-of-data message (or at all, when the run read none) and neither
  trained nor dropped; listed by id — a violation (issue 47).

``published`` = every sequence that is not a dead-letter copy. The stream's own sequences cannot
show messages the server lost after acknowledging them (a NATS host crash with unflushed pages,
RELIABILITY F3: the stream restarts shorter and reuses the lost sequences). The rollout
service's *published record* (``<run dir>/rollout/published.jsonl``: the id of every PubAck)
can: ``lost_after_ack`` counts the ids it holds that are neither accounted for by the ledger nor
stored in the stream (by ``Nats-Msg-Id``) — a violation. The exit status is 1 when anything
is lost (either way), trained twice or unconsumed at the end, else 0. NATS: ``--nats``, else the run's ``nats.url``, else its running
embedded server, else an embedded server started on the run's store for the audit.

Not covered: ledgers written before stream sequences were recorded (their ids are counted, but
their sequences cannot be matched: they show as lost unless still in the stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer_daemon.state.checkpoint import complete_checkpoints
from trainer_daemon.state.ledger import (
    ID_KINDS,
    ledger_accounts,
    lost_steps,
    read_finished,
    read_lineage,
)

SHOW = 10  # ids/sequences listed per violation
END_MESSAGE = "<end of data>"  # read_stream's id for the rollout's end-of-data message (not a trajectory)


@dataclass
class Audit:
    published: int = 0
    trained: int = 0
    dropped: int = 0
    duplicate: int = 0
    poison: int = 0
    dlq: int = 0
    end: int = 0
    """The rollout's end-of-data message, read by the trainer (asyncrl.wire.end_of_data)."""
    pending: int = 0
    since_checkpoint: int = 0
    """Gone from the stream, accounted for by the ledger's journal: committed after the newest
    complete checkpoint (a live trainer's steps since it, or a crashed one's, recorded as lost
    steps when it restarts). With ``save_freq = 0`` every trained message is here until the
    run's final checkpoint (the stream is purged at each commit)."""
    lost: int = 0
    twice: int = 0
    lost_after_ack: int = 0
    """Ids the rollout service had a PubAck for, neither in the ledger nor in the stream now."""
    lost_after_ack_ids: list[str] = field(default_factory=list)
    checkpoint_step: int | None = None
    lost_steps: int = 0
    """Steps trained after a checkpoint and lost with a crash (recorded at the restart; their
    data was trained again along the lineage: not a violation)."""
    lost_step_trajectories: int = 0
    lost_seqs: list[int] = field(default_factory=list)
    twice_ids: list[str] = field(default_factory=list)
    finished: str | None = None
    """Why the run ended at the audited checkpoint (``data_ended``, ``total_steps``); None: not ended there."""
    unconsumed_at_end: int = 0
    unconsumed_ids: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.twice == 0 and self.lost_after_ack == 0 and self.unconsumed_at_end == 0


def reconcile(entries: list[dict[str, Any]], stream: dict[int, str], last_seq: int, dlq_subject: str,
              finished: str | None = None, stream_ids: dict[int, str] | None = None,
              journal: list[dict[str, Any]] = ()) -> Audit:
    """The audit of a lineage's ``entries`` against ``stream`` (sequence → subject of every
    message still stored) up to ``last_seq`` (module docstring); ``finished``: the run ended at
    this lineage's checkpoint; ``stream_ids``: sequence → ``Nats-Msg-Id`` of stored messages;
    ``journal``: the ledger's entries committed after that checkpoint (``since_checkpoint``)."""
    kinds, trained_ids = ledger_accounts(entries)
    later, _ = ledger_accounts(list(journal))  # consulted only for sequences gone from the stream
    out = Audit(finished=finished)
    ends = [seq for seq, kind in kinds.items() if kind == "end"]
    end_seq = min(ends) if ends else last_seq + 1
    for seq in range(1, last_seq + 1):
        kind = kinds.get(seq) or ("dlq" if stream.get(seq) == dlq_subject else None)
        if kind is None and (stream_ids or {}).get(seq) == END_MESSAGE:
            kind = "end"  # the rollout's marker, stored, not read by a trainer that stopped at its total steps
        if kind is None:
            kind = "pending" if seq in stream else "since_checkpoint" if seq in later else "lost"
            if kind == "lost" and len(out.lost_seqs) < SHOW:
                out.lost_seqs.append(seq)
            if kind == "pending" and finished and seq < end_seq:
                out.unconsumed_at_end += 1
                if len(out.unconsumed_ids) < SHOW:
                    out.unconsumed_ids.append((stream_ids or {}).get(seq, f"seq {seq}"))
        setattr(out, kind, getattr(out, kind) + 1)
    out.published = last_seq - out.dlq - out.end
    twice = [i for i, n in trained_ids.items() if n > 1]
    out.twice, out.twice_ids = len(twice), sorted(twice)[:SHOW]
    return out


def lost_after_ack(published: list[dict[str, Any]], entries: list[dict[str, Any]], stored_ids: set[str]) -> list[str]:
    """Ids of ``published`` (the rollout's record) neither in the ledger's ``entries`` (the
    lineage's and the journal's) nor stored."""
    accounted = {i for e in entries for kind in ID_KINDS for i in e.get(kind, [])}
    seen: dict[str, None] = {}
    for r in published:
        seen.setdefault(r["id"], None)
    return [i for i in seen if i not in accounted and i not in stored_ids]


async def read_stream(url: str, stream: str, user: str | None = None, password: str | None = None,
                      ids: set[str] | None = None, seq_ids: dict[int, str] | None = None) -> tuple[dict[int, str], int]:
    """Subject of every stored message, and the stream's last sequence; ``ids`` (if given) gets
    every stored message's ``Nats-Msg-Id``, ``seq_ids`` (if given) the same by sequence."""
    from nats.js.errors import NotFoundError

    from asyncrl.jetstream import connect
    from asyncrl.wire import is_end_of_data

    nc = await connect(url, "asyncrl-audit", user=user, password=password, persistent=False)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        first, last = int(info.state.first_seq), int(info.state.last_seq)
        out: dict[int, str] = {}
        for seq in range(max(first, 1), last + 1):
            try:
                msg = await js.get_msg(stream, seq)
            except NotFoundError:
                continue  # deleted inside the range
            out[seq] = msg.subject
            if seq_ids is not None and is_end_of_data(msg.headers):
                seq_ids[seq] = END_MESSAGE
            elif msg.headers and msg.headers.get("Nats-Msg-Id"):
                if ids is not None:
                    ids.add(msg.headers["Nats-Msg-Id"])
                if seq_ids is not None:
                    seq_ids[seq] = msg.headers["Nats-Msg-Id"]
        return out, last
    finally:
        await nc.close()


def _run_config(run_dir: Path, run_id: str | None):
    from asyncrl.config import load_config

    files = [p for p in (run_dir / "config.yaml", run_dir / "config.json") if p.is_file()]
    overrides = [f"run.dir={run_dir}"] + ([f"run.id={run_id}"] if run_id else [])
    return load_config(files[0] if files else None, overrides=overrides, environ={})


async def audit_run(run_dir: Path, nats_url: str | None, run_id: str | None, *, user: str | None = None,
                    password: str | None = None) -> Audit:
    """The audit of the run in ``run_dir`` (module docstring). ``user``/``password``: NATS'
    credentials when the caller has them (the trainer at its end: its config may not be a file
    in the run directory), else the run's config's."""
    from asyncrl.jetstream import EmbeddedNats, resolve_nats_url
    from asyncrl.wire import NatsNames

    cfg = _run_config(run_dir, run_id)
    names = NatsNames(cfg.run.id)
    found = complete_checkpoints(run_dir / "checkpoints")
    step = found[-1][0] if found else None
    entries = read_lineage(run_dir / "checkpoints", step) if step is not None else []
    server = None
    try:
        url = nats_url or resolve_nats_url(cfg.nats.url, run_dir)
    except LookupError:
        server = EmbeddedNats(run_dir, jetstream_dir=cfg.nats.store_dir)
        server.start()
        url = server.url
    from asyncrl.config import secret

    try:
        stored_ids: set[str] = set()
        seq_ids: dict[int, str] = {}
        stream, last = await read_stream(url, names.stream, user or cfg.nats.user, password or secret(cfg.security.nats_password),
                                         stored_ids, seq_ids)
    finally:
        if server is not None:
            server.stop()
    marked = read_finished(run_dir / "checkpoints")
    finished = marked["reason"] if marked and step is not None and int(marked["step"]) == step else None
    journal = lost_steps(run_dir / "checkpoints", step or 0)
    out = reconcile(entries, stream, last, names.dead_letters, finished, seq_ids, journal)
    out.checkpoint_step = step
    from asyncrl.jsonl_log import BoundedJsonl

    published = BoundedJsonl(run_dir / "rollout" / "published.jsonl", 1).read()
    gone = lost_after_ack(published, [*entries, *journal], stored_ids)
    out.lost_after_ack, out.lost_after_ack_ids = len(gone), gone[:SHOW]
    lost = [s for e in entries for s in e.get("lost_steps", [])]
    out.lost_steps, out.lost_step_trajectories = len(lost), sum(len(s.get("trained", [])) for s in lost)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl audit", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--nats", default=None, help="NATS URL (default: the run's)")
    p.add_argument("--run-id", default=None, help="run id (default: the run's config)")
    p.add_argument("--json", action="store_true", help="print the audit as JSON")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.run_dir.is_dir():
        print(f"asyncrl audit: {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    result = asyncio.run(audit_run(args.run_dir, args.nats, args.run_id))
    if args.json:
        print(json.dumps(asdict(result) | {"ok": result.ok}))
    else:
        step = result.checkpoint_step
        print(f"checkpoint lineage: step {step}" if step is not None else "checkpoint lineage: none yet (no complete checkpoint)")
        for key in ("published", "trained", "dropped", "duplicate", "poison", "dlq", "pending", "lost", "twice", "lost_after_ack"):
            print(f"  {key:<10} {getattr(result, key)}")
        if result.since_checkpoint:
            print(f"  trained since the checkpoint (the ledger's journal): {result.since_checkpoint}")
        if result.lost_steps:
            print(f"  steps lost with a crash and retrained: {result.lost_steps} ({result.lost_step_trajectories} trajectories)")
        if result.lost_seqs:
            print(f"  lost sequences (first {SHOW}): {result.lost_seqs}")
        if result.lost_after_ack_ids:
            print(f"  acknowledged by NATS, then lost (first {SHOW}): {result.lost_after_ack_ids}")
        if result.twice_ids:
            print(f"  trained twice (first {SHOW}): {result.twice_ids}")
        if result.finished:
            print(f"  the run ended at this checkpoint ({result.finished}); unconsumed at the end: {result.unconsumed_at_end}")
        if result.unconsumed_ids:
            print(f"  unconsumed at the end, neither trained nor dropped (first {SHOW}): {result.unconsumed_ids}")
        print("OK" if result.ok else "VIOLATION: trajectories lost, trained twice or left unconsumed at the end")
    return 0 if result.ok else 1
