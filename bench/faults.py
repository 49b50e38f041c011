"""Recovery times after control-plane faults mid-sync, on the whole loop as real processes
(issue 33; RELIABILITY.md L2).

    python bench/faults.py [--faults engine-kill,agent-kill,engine-hang] [--rounds 1] [--restart-after-s 5]
        [--watch-s 90] [--run-dir DIR] [section.key=value ...]

The stack is ``asyncrl up``'s (:class:`launcher.up.stack.Stack`): embedded NATS, two local
engines with the demo policy, the rollout service, the sync agent and a torchrun trainer, on the
demo config (partial rollout, a sync every step) with small buckets, so that a sync has many.
Each fault strikes at the same point of a sync: the trainer holds at the failpoint
``trainer.sync_bucket`` (asyncrl/failpoints.py) after the first bucket, so the engines hold part
new, part old weights; the bench injects the fault there and releases the trainer.

- ``engine-kill`` (F8): SIGKILL engine-1; restart it ``--restart-after-s`` later on its port.
  ``survivor decoding``: from the kill to engine-0 routable and decoding again;
  ``restarted serving``: from the restarted engine answering /health to it routable at the
  run's current version and decoding.
- ``agent-kill`` (F9): SIGKILL the sync agent; restart it ``--restart-after-s`` later.
  ``decoding``: from the agent answering /health to every engine routable and decoding.
- ``engine-hang`` (F16): SIGSTOP engine-1, SIGCONT once the sync it hung has ended.
  ``survivor decoding``: from the SIGSTOP to engine-0 routable and decoding;
  ``hung serving``: from the SIGCONT to engine-1 routable at the current version and decoding.

"Decoding" is the rollout service's count of tokens an engine decoded rising by 16 in its
``/admin/status``; polled every 0.1 s. A figure not reached within ``--watch-s`` prints as
``> watch``. Printed beside the bound of RELIABILITY.md (10 s). Every figure is of one machine
at one moment: run it quiet, several rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BOUND_S = 10.0
FAILPOINT = "trainer.sync_bucket"
DECODED = 16  # tokens: "decoding again"


class Run:
    """The stack, its tokens, and the probes the bench reads."""

    def __init__(self, stack, fp_dir: Path) -> None:
        self.stack, self.fp = stack, fp_dir
        sec = stack.doc["security"]
        self.admin = {"Authorization": f"Bearer {sec['admin_token']}"}
        self.sync = {"Authorization": f"Bearer {sec['sync_token']}"}
        self.http = httpx.AsyncClient(timeout=3)

    async def engines(self) -> dict[str, dict]:
        """``{url: engine view}`` from the rollout service (empty when it does not answer)."""
        try:
            doc = (await self.http.get(f"{self.stack.urls['rollout']}/admin/status", headers=self.admin)).json()
        except (httpx.HTTPError, ValueError):
            return {}
        return {e["url"]: e for e in doc.get("engines", [])}

    async def agent(self) -> dict | None:
        try:
            r = await self.http.get(f"{self.stack.urls['sync']}/status", headers=self.sync)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def last_sync(self) -> dict | None:
        try:
            syncs = (await self.http.get(f"{self.stack.urls['sync']}/v1/syncs", headers=self.sync)).json()["syncs"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return syncs[-1] if syncs else None

    async def up(self, url: str) -> bool:
        try:
            return (await self.http.get(f"{url}/health", timeout=1)).status_code == 200
        except httpx.HTTPError:
            return False

    async def serving(self, url: str, since: dict[str, int], current: bool = False) -> bool:
        """``url`` routable and decoded ``DECODED`` tokens more than ``since[url]``; with ``current``,
        at the sync agent's current version."""
        e = (await self.engines()).get(url)
        if e is None or e["state"] != "healthy" or e["tokens_decoded"] < since.get(url, 0) + DECODED:
            return False
        if current:
            a = await self.agent()
            return a is not None and e["weight_version"] == a["version"]
        return True

    # -- the failpoint ----------------------------------------------------------------------
    def arm(self) -> None:
        for p in self.fp.glob(f"{FAILPOINT}.*"):
            p.unlink()
        (self.fp / f"{FAILPOINT}.arm").touch()

    def release(self) -> None:
        (self.fp / f"{FAILPOINT}.arm").unlink(missing_ok=True)
        (self.fp / f"{FAILPOINT}.release").touch()

    def held(self) -> bool:
        return any(self.fp.glob(f"{FAILPOINT}.reached.*"))


async def until(pred, timeout_s: float, interval_s: float = 0.1) -> float | None:
    """Seconds until the async ``pred()`` is true, None after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await pred():
            return time.monotonic() - start
        await asyncio.sleep(interval_s)
    return None


async def steady(run: Run, timeout_s: float = 300.0) -> None:
    """Every engine routable at the current version and decoding."""
    since = {u: e["tokens_decoded"] for u, e in (await run.engines()).items()}

    async def ok() -> bool:
        return all([await run.serving(u, since, current=True) for u in run.stack.doc["engines"]["urls"]])

    if await until(ok, timeout_s) is None:
        raise SystemExit(f"the loop did not reach a steady state within {timeout_s:.0f} s: {await run.engines()}")


async def strike(run: Run, timeout_s: float = 300.0) -> dict[str, int]:
    """Hold the trainer inside the next sync's broadcast; the tokens each engine decoded then."""
    run.arm()
    if await until(lambda: asyncio.sleep(0, run.held()), timeout_s) is None:
        raise SystemExit("no sync reached the failpoint")

    async def first_bucket_loaded() -> bool:  # every member applied it: they are mixed from here on
        rec = await run.last_sync()
        return rec is not None and rec["state"] == "loading" and rec.get("bytes", 0) > 0

    if await until(first_bucket_loaded, 60, interval_s=0.02) is None:
        raise SystemExit(f"the held sync's first bucket was not loaded: {await run.last_sync()}")
    return {u: e["tokens_decoded"] for u, e in (await run.engines()).items()}


async def engine_kill(run: Run, a) -> dict[str, float | None]:
    urls = run.stack.doc["engines"]["urls"]
    child = run.stack.children["engine-1"]
    since = await strike(run)
    child.kill()
    killed = time.monotonic()
    run.release()
    restart = asyncio.create_task(asyncio.sleep(a.restart_after_s))
    survivor = await until(lambda: run.serving(urls[0], since), a.watch_s)
    await restart
    child.start()
    await until(lambda: run.up(urls[1]), 240)
    since = {u: e["tokens_decoded"] for u, e in (await run.engines()).items()}
    restarted = await until(lambda: run.serving(urls[1], since, current=True), a.watch_s)
    return {"survivor decoding": survivor, "restarted serving": restarted, "_kill_to_up": time.monotonic() - killed}


async def agent_kill(run: Run, a) -> dict[str, float | None]:
    urls = run.stack.doc["engines"]["urls"]
    child = run.stack.children["sync-agent"]
    await strike(run)
    child.kill()
    run.release()
    await asyncio.sleep(a.restart_after_s)
    child.start()
    await until(lambda: run.up(run.stack.urls["sync"]), 120)
    since = {u: e["tokens_decoded"] for u, e in (await run.engines()).items()}

    async def all_decoding() -> bool:
        return all([await run.serving(u, since) for u in urls])

    return {"decoding": await until(all_decoding, a.watch_s)}


async def engine_hang(run: Run, a) -> dict[str, float | None]:
    urls = run.stack.doc["engines"]["urls"]
    child = run.stack.children["engine-1"]
    since = await strike(run)
    hung_sync = (await run.last_sync() or {}).get("id")
    child.signal(signal.SIGSTOP)
    run.release()
    survivor = await until(lambda: run.serving(urls[0], since), a.watch_s)

    async def sync_ended() -> bool:
        rec = await run.last_sync()
        return rec is not None and (rec["id"] != hung_sync or rec["state"] in ("succeeded", "failed"))

    await until(sync_ended, 600)
    child.signal(signal.SIGCONT)
    since = {u: e["tokens_decoded"] for u, e in (await run.engines()).items()}
    hung = await until(lambda: run.serving(urls[1], since, current=True), a.watch_s)
    return {"survivor decoding": survivor, "hung serving": hung}


FAULTS = {"engine-kill": engine_kill, "agent-kill": agent_kill, "engine-hang": engine_hang}


@contextlib.asynccontextmanager
async def running_loop(run_dir: Path, overrides: list[str], progress=lambda m: None):
    """The whole loop on the demo config (two engines, small buckets, endless data), its children
    armed for the failpoint; yields a :class:`Run`. Everything is stopped on the way out."""
    from asyncrl.config import load_config
    from launcher.up.main import demo_config_path, demo_policy
    from launcher.up.stack import Stack

    shutil.rmtree(run_dir, ignore_errors=True)
    fp_dir = run_dir / "failpoints"
    fp_dir.mkdir(parents=True)
    cfg = load_config(demo_config_path(), [f"model.path={demo_policy()}", f"run.dir={run_dir}", "engines.num_local=2",
                                           "sync.bucket_bytes=65536", "rollout.total_rollout_steps=1000000", *overrides])
    stack = Stack(cfg, run_dir)
    run = None
    before = os.environ.get("ASYNCRL_FAILPOINTS")
    os.environ["ASYNCRL_FAILPOINTS"] = str(fp_dir)  # every child inherits it (restored on the way out)
    try:
        await asyncio.to_thread(stack.start, progress)
        run = Run(stack, fp_dir)
        yield run
    finally:
        if run is not None:
            await run.http.aclose()
        await asyncio.to_thread(stack.stop)
        if before is None:
            os.environ.pop("ASYNCRL_FAILPOINTS", None)
        else:
            os.environ["ASYNCRL_FAILPOINTS"] = before


async def main_async(a, overrides: list[str]) -> int:
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="asyncrl-faults-"))
    results: dict[str, list[dict[str, float | None]]] = {f: [] for f in a.faults}
    async with running_loop(run_dir, overrides, lambda m: print(f"[faults] {m}", flush=True)) as run:
        for r in range(a.rounds):
            for name in a.faults:
                await steady(run)
                print(f"[faults] round {r + 1}: {name} ...", flush=True)
                res = await FAULTS[name](run, a)
                results[name].append(res)
                print(f"[faults]   {fmt(res, a.watch_s)}", flush=True)
    print(f"\nrecovery after each fault mid-sync (bound {BOUND_S:g} s; logs in {run_dir / 'logs'})")
    for name, rounds in results.items():
        for key in [k for k in (rounds[0] if rounds else {}) if not k.startswith("_")]:
            vals = [x[key] for x in rounds]
            done = [v for v in vals if v is not None]
            med = f"{statistics.median(done):.1f} s" if len(done) == len(vals) else f"> {a.watch_s:g} s"
            print(f"  {name:12s} {key:18s} median {med:>9s}  rounds {', '.join(show(v, a.watch_s) for v in vals)}  "
                  f"bound {'held' if len(done) == len(vals) and max(done) <= BOUND_S else 'MISSED'}")
    return 0


def show(v: float | None, watch_s: float) -> str:
    return f"{v:.1f}" if v is not None else f">{watch_s:g}"


def fmt(res: dict[str, float | None], watch_s: float) -> str:
    return ", ".join(f"{k}: {show(v, watch_s)} s" for k, v in res.items() if not k.startswith("_"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", default="engine-kill,agent-kill,engine-hang")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--restart-after-s", type=float, default=5.0)
    p.add_argument("--watch-s", type=float, default=90.0)
    p.add_argument("--run-dir")
    a, overrides = p.parse_known_args()
    a.faults = [f for f in a.faults.split(",") if f]
    unknown = set(a.faults) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}: {sorted(FAULTS)}")
    return asyncio.run(main_async(a, overrides))


if __name__ == "__main__":
    sys.exit(main())
