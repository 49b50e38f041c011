"""``asyncrl up [CONFIG] [section.key=value ...] [--max-minutes M] [--no-live] [--resume]``.

Runs fully asynchronous RL end to end on this machine: embedded NATS, local engines (or the
configured SGLang URLs), the rollout service, the sync agent and the trainer, as child
processes (:mod:`.stack`); a live terminal view (:mod:`.live`); and at the end a summary
and a PNG plot in the run directory (:mod:`.report`). With no config it runs the built-in
demo (``launcher/up/demo.toml``): ``builtin:tiny-arith`` learning to pick the exact tool on an
arithmetic task; that policy is the trainer's SFT warm-up (``python -m recipes.demo.warmup``,
run as a child process: it returns the build shipped in the package at once, or builds and
caches it when the code that determines it changed).

It stops cleanly on Ctrl-C, when the trainer finishes (``total_rollout_steps`` reached), or
after ``--max-minutes``; a child that dies stops the run with its log tail. Exit status: 0
unless a child failed. A previous run in the same directory is moved aside
(``<dir>.prev``) unless ``--resume``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from asyncrl.config import ConfigError, load_config, secret
from asyncrl.files import private_dir
from asyncrl.http.keepalive import client_session
from asyncrl.launch import log_tail
from asyncrl.logs import configure_logging

SYNC_POLL_S = 3.0
TICK_S = 0.5
DEMO_MODEL = "builtin:tiny-arith"  # the model.path that asks for the demo's warmed-up policy
WARMUP_TIMEOUT_S = 3600.0  # shipped: instant; built (changed code): ~2 min on 2 CPU cores, once; an hour means it is stuck


def demo_config_path() -> str:
    return str(resources.files("launcher.up") / "demo.toml")


def demo_policy() -> str | None:
    """The directory of the demo's warmed-up policy, from the trainer's warm-up entry point
    (its progress goes to this terminal); None, reported, when it fails."""
    argv = [sys.executable, "-m", "recipes.demo.warmup"]
    try:
        out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=WARMUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"[asyncrl up] the demo warm-up did not finish within {WARMUP_TIMEOUT_S:.0f} s", file=sys.stderr)
        return None
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        print(f"[asyncrl up] the demo warm-up ({' '.join(argv[1:])}) failed with exit code {out.returncode}", file=sys.stderr)
        return None
    return lines[-1]


def where_to_look(run_dir: Path, doc: dict) -> list[str]:
    """The lines ``asyncrl up`` prints once its services are up: where the run's files,
    metrics and status are, and how to stop it."""
    trainer_port = doc["trainer"]["metrics_port"]
    return [
        "where to look:",
        f"  run dir   {run_dir}  (logs/, metrics/trainer.jsonl, tensorboard/; summary.md and summary.png at the end)",
        f"  metrics   {doc['sync']['rollout_url']}/metrics (rollout)  http://127.0.0.1:{trainer_port}/metrics (trainer)  "
        f"{doc['sync']['url']}/metrics (sync agent)",
        f"  status    {doc['sync']['rollout_url']}/admin/status  {doc['sync']['url']}/status",
        "  stop      Ctrl-C: every process stops cleanly; `asyncrl up --resume` continues from the last checkpoint",
    ]


async def _watch(stack, cfg, live_view: bool, deadline: float | None, stop: asyncio.Event) -> tuple[str, bool]:
    """Run until something ends the run; returns (reason, failed)."""
    import aiohttp
    from rich.console import Console
    from rich.live import Live

    from asyncrl.jetstream import connect
    from launcher.up.live import MetricsTap, health_line, render

    tap = MetricsTap(cfg.run.id, stack.run_dir)
    nc = await connect(stack.urls["nats"], "asyncrl-up", **stack.nats_auth())
    await tap.start(nc)
    token = secret(cfg.security.sync_token)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    admin = stack.doc["security"].get("admin_token") if getattr(stack, "doc", None) else None
    admin_headers = {"Authorization": f"Bearer {admin}"} if admin else {}
    shown_health = None
    console = Console()
    last_poll = 0.0
    reason, failed = "interrupted", False
    live = Live(render(tap, cfg.run.id, "running"), console=console, refresh_per_second=2, transient=False) if live_view else None
    try:
        if live:
            live.start()
        async with client_session() as http:
            while not stop.is_set():
                if time.monotonic() - last_poll > SYNC_POLL_S:
                    last_poll = time.monotonic()
                    try:
                        async with http.get(f"{stack.urls['sync']}/v1/syncs", headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as r:
                            syncs = (await r.json()).get("syncs", [])
                            tap.sync = {"all": syncs, "last": next((s for s in reversed(syncs) if s["state"] in ("succeeded", "failed")), None)}
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        pass
                    try:
                        async with http.get(f"{stack.urls['rollout']}/admin/status", headers=admin_headers,
                                            timeout=aiohttp.ClientTimeout(total=5)) as r:
                            tap.health = (await r.json()).get("health")
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        pass
                    line = health_line(tap.health)
                    if not live and line is not None and line != shown_health:  # logs only: each change once
                        console.print(f"run health: {line}")
                    shown_health = line
                for name, code in stack.exited():
                    if name == "trainer" and code == 0:
                        return "the trainer finished its steps (total_rollout_steps reached, or the rollout's data ended)", False
                    tail = log_tail(stack.children[name].log_path, 3000)
                    return f"{name} exited with code {code}; last log lines:\n{tail}", True
                if deadline is not None and time.monotonic() > deadline:
                    return "time limit reached", False
                if live:
                    live.update(render(tap, cfg.run.id, "running"))
                await asyncio.sleep(TICK_S)
    finally:
        if live:
            live.update(render(tap, cfg.run.id, "stopping"))
            live.stop()
        await tap.close()
        await nc.close()
        stack.sync_records = (tap.sync or {}).get("all", [])
    return reason, failed


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", help="[CONFIG_FILE] [section.key=value ...] (no file: the built-in demo)")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop after this long")
    parser.add_argument("--no-live", action="store_true", help="no live view (logs only; also when the output is not a terminal)")
    parser.add_argument("--resume", action="store_true", help="keep the run directory (checkpoints, NATS store) and resume")
    ns = parser.parse_args(argv)
    from asyncrl.cli_args import split_config_args as _split_config_args
    from launcher.up.report import summarize
    from launcher.up.run_lock import RunDirInUse, hold_run_dir
    from launcher.up.stack import PortInUse, Stack, refuse_taken_ports

    path, overrides = _split_config_args(ns.args)
    path = path or demo_config_path()
    try:
        cfg = load_config(path, overrides)
    except ConfigError as exc:
        print(f"asyncrl up: {exc}", file=sys.stderr)
        return 2
    try:  # refused before anything starts or prints: one line, exit 2
        held = hold_run_dir(Path(cfg.run_dir).resolve())  # noqa: F841 - the lock lives while this process holds the file
        refuse_taken_ports(cfg)
    except (RunDirInUse, PortInUse) as exc:
        print(f"asyncrl up: {exc}", file=sys.stderr)
        return 2
    configure_logging(cfg.run.log_level, json_lines=cfg.run.log_json, tag="up")
    print(f"[asyncrl up] run {cfg.run.id!r} in {Path(cfg.run_dir).resolve()}; Ctrl-C stops it cleanly", flush=True)
    if cfg.model.path == DEMO_MODEL:
        warm = demo_policy()
        if warm is None:
            return 1
        cfg = load_config(path, [*overrides, f"model.path={warm}"])
    elif cfg.model.path.startswith("builtin:"):
        # a builtin that is downloaded or converted on first use (SmolLM2) is prepared here, where
        # its progress shows, rather than inside an engine whose output goes to a log file
        from asyncrl.models import ModelSpecError, resolve_model_dir

        try:
            resolve_model_dir(cfg.model.path)
        except ModelSpecError as exc:
            print(f"[asyncrl up] {exc}", file=sys.stderr)
            return 2
    run_dir = Path(cfg.run_dir).resolve()
    if run_dir.exists() and not ns.resume:
        prev = run_dir.with_name(run_dir.name + ".prev")
        shutil.rmtree(prev, ignore_errors=True)
        run_dir.rename(prev)
        print(f"moved the previous run to {prev}")
    private_dir(run_dir)
    stack = Stack(cfg, run_dir)
    stop = asyncio.Event()
    started = time.monotonic()
    reason, failed = "interrupted", False

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cfg = stack.start(progress=lambda m: print(f"[asyncrl up] {m}", flush=True))
        for line in where_to_look(run_dir, stack.doc):
            print(f"[asyncrl up] {line}", flush=True)
        deadline = started + ns.max_minutes * 60 if ns.max_minutes else None
        live_view = not ns.no_live and sys.stdout.isatty()  # piped or captured: plain lines, not redrawn frames
        reason, failed = asyncio.run(_watch(stack, cfg, live_view, deadline, stop))
    except Exception as exc:  # noqa: BLE001 - report any start-up failure clearly, then clean up
        reason, failed = f"{type(exc).__name__}: {exc}", True
    finally:
        print(f"[asyncrl up] stopping: {reason.splitlines()[0] if reason else ''}", flush=True)
        stack.stop()
    if failed:
        print(f"[asyncrl up] run failed: {reason}", file=sys.stderr)
    summary = summarize(run_dir, cfg.run.id, reason.splitlines()[0], time.monotonic() - started, getattr(stack, "sync_records", []))
    print(f"[asyncrl up] summary: {summary}")
    return 1 if failed else 0
