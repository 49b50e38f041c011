"""The verifiers driver: ``python -m rollout_service.verifiers_env.driver SPEC_JSON``.

A child process of the rollout service (started and restarted by :mod:`.supervisor`, never by
hand). It loads a verifiers environment (the classic API, ``verifiers.load_environment``:
``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, ... with their ``Rubric``) and plays its
dataset as GRPO groups through asyncrl sessions:

1. for group ``g`` (:class:`.plan.GroupPlan` picks its row) it opens ``n`` sessions on the
   service (``POST /v1/sessions`` with ``group_id``, ``group_size``, ``group_index``); the first
   one is the group's admission, refused with 429 / 503 while the staleness quota is used up,
   the service is paused for a weight sync or its outbox is full: the driver waits
   ``Retry-After`` (capped) and asks again. Then it saves its progress (:class:`.plan.Progress`);
2. each member runs ``env.rollout(input, client, model, sampling_args)`` with its own OpenAI
   client at its session's ``base_url``: every completion the environment asks for is a turn
   of the session, recorded token-exactly by the service;
3. the group is scored by the environment's rubric (``rubric.score_group``: per-rollout and
   group reward functions alike); each member posts ``{"reward": <the rubric's weighted sum>,
   "components": <every function's score>}`` and finishes its session, which publishes it.

Failures are never training signal: a rollout that raised or ended with an error in its
state (the model call failed: ``engine_error``; anything else: ``agent_crash``) and a rubric
that raised (``reward_error``) finish their sessions with that ``failure``, so the trainer
excludes them and trains the rest of the group. Episodes in flight run at most
``max_concurrent`` at once; a group starts only when all its members fit.

Exit status: 0 once every group of the plan is played (``progress.json`` says ``done``), 2
for an environment that cannot be loaded (not installed, ``load_environment`` failed), 1 for
anything else. It exits by itself when its parent (the rollout service) is gone.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp

from asyncrl.http.keepalive import client_session
from rollout_service.verifiers_env.plan import GroupPlan, Progress
from rollout_service.verifiers_env.reward_guard import guard_rubric, recording
from rollout_service.verifiers_env.spec import INSTALL_HINT, PROGRESS_FILE, TOKEN_ENV, DriverSpec

log = logging.getLogger("asyncrl.verifiers_driver")

PARENT_CHECK_S = 1.0
CONNECT_RETRY_S = 1.0
CONNECT_ATTEMPTS = 120  # the service answers within seconds of starting us; two minutes means it is gone
EXIT_LOAD_FAILED = 2


class EnvironmentLoadError(RuntimeError):
    """The environment cannot be loaded: a configuration problem, not worth restarting for."""


def load_environment(spec: DriverSpec):
    try:
        import verifiers as vf
    except ImportError as exc:
        raise EnvironmentLoadError(f"data.source verifiers:{spec.env_id} needs the verifiers package: {INSTALL_HINT}") from exc
    if not hasattr(vf, "load_environment") or not hasattr(vf, "Environment"):
        raise EnvironmentLoadError(f"verifiers {getattr(vf, '__version__', '?')} has no classic Environment API "
                                   "(verifiers.load_environment); asyncrl supports verifiers >= 0.1.8, < 0.4")
    try:
        env = vf.load_environment(spec.env_id, **spec.env_args)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's loader is reported as such
        raise EnvironmentLoadError(f"verifiers.load_environment({spec.env_id!r}, **{spec.env_args!r}) failed: {exc}") from exc
    if not isinstance(env, vf.Environment):
        raise EnvironmentLoadError(f"load_environment of {spec.env_id!r} returned {type(env).__name__}, not a verifiers Environment")
    guard_rubric(env.rubric)
    return env


def failure_of(state: dict[str, Any] | BaseException) -> tuple[str, str]:
    """``(failure, message)`` of a finished rollout; ``("", "")`` for a genuine episode."""
    import verifiers as vf

    if isinstance(state, BaseException):
        return "agent_crash", f"{type(state).__name__}: {state}"[:300]
    err = state.get("error")
    if err is None:
        return "", ""
    kind = "engine_error" if isinstance(err, vf.ModelError) else "agent_crash"
    cause = err.__cause__ or err
    return kind, f"{type(err).__name__}: {cause}"[:300]


def reward_body(state: dict[str, Any]) -> dict[str, Any]:
    """The session's reward: the rubric's weighted total, each function's score kept as a component."""
    metrics = {str(k): float(v) for k, v in (state.get("metrics") or {}).items() if v is not None}
    return {"reward": float(state.get("reward") or 0.0), "components": metrics}


class Driver:
    def __init__(self, spec: DriverSpec, token: str, env) -> None:
        self.spec, self.env = spec, env
        self.auth = {"Authorization": f"Bearer {token}"}
        self.http = client_session(timeout=aiohttp.ClientTimeout(total=spec.request_timeout_s))
        try:
            rows = env.get_dataset()
        except Exception as exc:  # noqa: BLE001 - an environment without a training dataset
            raise EnvironmentLoadError(f"environment {spec.env_id!r} has no training dataset: {exc}") from exc
        self.rows = rows
        self.plan = GroupPlan(len(rows), spec.total_epochs, spec.shuffle, spec.seed, spec.total_groups)
        self.progress_path = Path(spec.state_dir) / PROGRESS_FILE
        self.progress = Progress.load_or_new(self.progress_path, spec.env_id, self.plan, spec.n)
        self.slots = asyncio.Semaphore(max(spec.n, spec.max_concurrent))

    async def wait_for_service(self) -> None:
        for _ in range(CONNECT_ATTEMPTS):
            try:
                async with self.http.get(f"{self.spec.url}/health", timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(CONNECT_RETRY_S)
        raise RuntimeError(f"the rollout service at {self.spec.url} did not answer /health for {CONNECT_ATTEMPTS * CONNECT_RETRY_S:.0f} s")

    async def open_session(self, group_id: str, index: int, row: dict[str, Any]) -> dict[str, Any]:
        """A session of the group; waits out the service's backpressure (429 / 503 with Retry-After)."""
        body = {"group_id": group_id, "group_size": self.spec.n, "group_index": index, "data_source": self.spec.data_source,
                "prompt_id": str(row.get("example_id", "")), "metadata": {"verifiers_env": self.spec.env_id}}
        if isinstance(row.get("answer"), str | int | float):
            body["ground_truth"] = row["answer"]
        while True:  # bounded by the service: it refuses only while the trainer or a sync holds the run
            try:
                async with self.http.post(f"{self.spec.url}/v1/sessions", json=body, headers=self.auth) as r:
                    status, text, retry_after = r.status, await r.text(), r.headers.get("Retry-After", "1")
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("opening a session failed (%s); retrying", exc)
                await asyncio.sleep(CONNECT_RETRY_S)
                continue
            if status == 201:
                return json.loads(text)
            if status not in (429, 503):
                raise RuntimeError(f"POST /v1/sessions answered {status}: {text[:300]}")
            try:
                wait = float(retry_after)
            except ValueError:
                wait = 1.0
            await asyncio.sleep(min(max(wait, 0.1), self.spec.retry_after_cap_s))

    async def post(self, sess: dict[str, Any], action: str, body: dict[str, Any] | None = None) -> None:
        auth = {"Authorization": f"Bearer {sess['token']}"}
        async with self.http.post(f"{self.spec.url}/v1/sessions/{sess['id']}/{action}", json=body, headers=auth) as r:
            status, text = r.status, await r.text()
        if status != 200:
            raise RuntimeError(f"POST /v1/sessions/{sess['id']}/{action} answered {status}: {text[:300]}")
        if action == "finish":
            self.progress.open_sessions.pop(sess["id"], None)
            self.progress.save(self.progress_path)

    async def close_left_open(self) -> None:
        """Finish, as ``agent_crash``, the sessions a previous driver left open (it died mid-episode):
        their groups are released now rather than when the sessions expire."""
        for sid, token in list(self.progress.open_sessions.items()):
            try:
                await self.post({"id": sid, "token": token}, "finish",
                                {"failure": "agent_crash", "error": "the verifiers driver restarted mid-episode"})
            except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:  # already finished or expired: nothing to close
                log.info("session %s left open by the previous driver: %s", sid, exc)
            self.progress.open_sessions.pop(sid, None)
            self.progress.failed += 1
        self.progress.save(self.progress_path)

    async def play_group(self, group: int, row: dict[str, Any], first: dict[str, Any]) -> None:
        from openai import AsyncOpenAI
        from verifiers import OpenAIChatCompletionsClient

        group_id = f"vf{group:08d}"
        sessions = [first]
        for i in range(1, self.spec.n):
            sess = await self.open_session(group_id, i, row)
            self.progress.open_sessions[sess["id"]] = sess["token"]
            self.progress.save(self.progress_path)
            sessions.append(sess)
        clients = [OpenAIChatCompletionsClient(AsyncOpenAI(base_url=s["base_url"], api_key=s["token"],
                                                           timeout=self.spec.request_timeout_s, max_retries=3))
                   for s in sessions]
        try:
            results = await asyncio.gather(*(self.env.rollout(copy.deepcopy(row), c, self.spec.model, dict(self.spec.sampling))
                                             for c in clients), return_exceptions=True)
            outcomes = [failure_of(r) for r in results]
            scored = [r for r, (fail, _) in zip(results, outcomes) if not fail]
            reward_error = ""
            if scored:
                with recording() as raised:
                    try:
                        await self.env.rubric.score_group(scored)
                    except Exception as exc:  # noqa: BLE001 - the rubric's crash is reported, not trained
                        raised.append(f"{type(exc).__name__}: {exc}"[:300])
                if raised:
                    reward_error = raised[0]
                    log.warning("group %s: the rubric failed: %s", group_id, reward_error)
            for sess, result, (fail, message) in zip(sessions, results, outcomes):
                if not fail and reward_error:
                    fail, message = "reward_error", reward_error
                if not fail:
                    await self.post(sess, "reward", reward_body(result))
                else:
                    log.warning("episode %s (group %s): %s %s", sess["id"], group_id, fail, message)
                await self.post(sess, "finish", {"failure": fail, "error": message} if fail else None)
                self.progress.failed += bool(fail)
            for state in scored:
                await self.env.rubric.cleanup(state)
        finally:
            for c in clients:
                await c.close()
        self.progress.finished += 1
        self.progress.save(self.progress_path)

    async def run(self) -> None:
        await self.wait_for_service()
        await self.close_left_open()
        total = self.plan.total
        log.info("verifiers environment %s: %d rows, %d groups of %d, from group %d", self.spec.env_id, self.plan.rows,
                 total, self.spec.n, self.progress.started)
        running: set[asyncio.Task] = set()
        for group in range(self.progress.started, total):
            for _ in range(self.spec.n):
                await self.slots.acquire()
            row = dict(self.rows[self.plan.row(group)])
            first = await self.open_session(f"vf{group:08d}", 0, row)
            self.progress.open_sessions[first["id"]] = first["token"]
            self.progress.started = group + 1  # one write with the session: a restart never plays the group again
            self.progress.save(self.progress_path)
            task = asyncio.create_task(self._played(group, row, first), name=f"group-{group}")
            running.add(task)
            task.add_done_callback(running.discard)
        if running:
            await asyncio.gather(*running)
        self.progress.done = True
        self.progress.save(self.progress_path)
        log.info("verifiers environment %s: all %d groups played (%d episodes failed)", self.spec.env_id, total,
                 self.progress.failed)

    async def _played(self, group: int, row: dict[str, Any], first: dict[str, Any]) -> None:
        try:
            await self.play_group(group, row, first)
        except Exception:  # noqa: BLE001 - one broken group must not stop the others; its sessions expire
            log.exception("group %d failed", group)
            self.progress.errors += 1
            self.progress.save(self.progress_path)
        finally:
            for _ in range(self.spec.n):
                self.slots.release()


async def exit_when_orphaned(parent: int) -> None:
    """The service that started us is gone (we were re-parented): stop."""
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_S)
    log.warning("the rollout service (pid %d) is gone; the verifiers driver stops", parent)
    os._exit(1)


async def amain(spec: DriverSpec, token: str) -> int:
    parent = os.getppid()
    watchdog = asyncio.create_task(exit_when_orphaned(parent))
    try:
        env = load_environment(spec)  # on the main thread: environments may install signal handlers
    except EnvironmentLoadError as exc:
        log.error("%s", exc)
        return EXIT_LOAD_FAILED
    try:
        driver = Driver(spec, token, env)
    except (EnvironmentLoadError, ValueError) as exc:
        log.error("%s", exc)
        return EXIT_LOAD_FAILED
    try:
        await driver.run()
    finally:
        watchdog.cancel()
        await driver.http.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m rollout_service.verifiers_env.driver SPEC_JSON (started by the rollout service)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    spec = DriverSpec.model_validate(json.loads(Path(args[0]).read_text()))
    return asyncio.run(amain(spec, os.environ.get(TOKEN_ENV, "")))


if __name__ == "__main__":
    sys.exit(main())
