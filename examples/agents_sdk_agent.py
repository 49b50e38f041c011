"""An OpenAI Agents SDK agent, unmodified, trained by asyncrl through sessions.

The agent is plain Agents SDK code: ``Agent`` with two function tools (asyncrl's demo tools,
``calculator`` and ``estimate``, executed here by the agent itself) and the SDK's default model,
the Responses API, pointed at a session's base URL. This driver plays the demo task's
questions (or ``--data``, verl-layout JSONL) in GRPO groups: per question ``--n`` sessions of one
group, each one agent run; it reads the last ``\\boxed{N}`` of the agent's final answer, sets
the reward (1 if it is the ground truth) and finishes the session, which publishes the episode
(exact tokens, log-probs, per-token versions; the tool outputs masked) to the trainer.

Against a run whose data comes only from sessions::

    asyncrl up data.source=sessions trainer.total_training_steps=60
    python examples/agents_sdk_agent.py --url http://127.0.0.1:8000   # + --api-token T when the data plane has one

It plays until the service goes away (the run ended) or ``--groups`` groups are done. Prints one line per group (its rewards) and a summary. Needs ``openai-agents``
and ``httpx`` (both in the dev extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIResponsesModel,
    RunContextWrapper,
    Runner,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tools.registry import ToolRegistry

BOXED = re.compile(r"\\boxed\{([^}]*)\}")


def sdk_tools(names: tuple[str, ...] = ("calculator", "estimate")) -> list[FunctionTool]:
    """asyncrl's tools as Agents SDK function tools: the same names, descriptions and JSON schemas
    the service's own agents use, run by the agent process."""
    registry = ToolRegistry.from_names(names)

    def invoker(name: str):
        async def invoke(ctx: RunContextWrapper[Any], arguments: str) -> str:
            return (await registry.execute(name, arguments, timeout_s=10)).content

        return invoke

    return [FunctionTool(name=s["function"]["name"], description=s["function"]["description"],
                         params_json_schema=s["function"]["parameters"], on_invoke_tool=invoker(s["function"]["name"]),
                         strict_json_schema=False) for s in registry.schemas()]


def reward_of(final_output: Any, ground_truth: str) -> float:
    boxed = BOXED.findall(str(final_output or ""))
    return float(bool(boxed) and boxed[-1].strip() == ground_truth)


class Service:
    """The rollout service's session routes (data-plane token)."""

    def __init__(self, url: str, api_token: str | None) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {api_token}"} if api_token else {})
        self.model = ""

    async def served_model(self) -> str:
        """The served model's name (``GET /v1/models``): what every request names."""
        r = await self.http.get(f"{self.url}/v1/models")
        r.raise_for_status()
        self.model = r.json()["data"][0]["id"]
        return self.model

    async def open(self, group: str, size: int, index: int, data_source: str, stop: asyncio.Event) -> dict | None:
        """A new session of ``group``; waits out 429/503 (quota, sync pause); None once ``stop`` is set."""
        body = {"group_id": group, "group_size": size, "group_index": index, "data_source": data_source}
        while not stop.is_set():
            try:
                r = await self.http.post(f"{self.url}/v1/sessions", json=body)
            except httpx.TransportError:  # the service is gone: the run ended
                stop.set()
                return None
            if r.status_code == 201:
                return r.json()
            if r.status_code not in (429, 503):
                raise RuntimeError(f"POST /v1/sessions: {r.status_code} {r.text}")
            await asyncio.sleep(min(2.0, float(r.headers.get("Retry-After", "1"))))
        return None

    async def close(self, session: dict, reward: float | None, failure: str | None = None) -> None:
        auth = {"Authorization": f"Bearer {session['token']}"}
        base = f"{self.url}/v1/sessions/{session['id']}"
        if reward is not None:
            (await self.http.post(f"{base}/reward", json={"reward": reward}, headers=auth)).raise_for_status()
        body = {"failure": failure, "error": "the agent failed"} if failure else None
        (await self.http.post(f"{base}/finish", json=body, headers=auth)).raise_for_status()


async def episode(service: Service, session: dict, question: str, ground_truth: str, tools: list[FunctionTool],
                  model_settings: ModelSettings) -> float | None:
    """One agent run on one session; its reward (None: the agent failed, the episode is marked so)."""
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["token"], timeout=300, max_retries=2)
    agent = Agent(name="arith", tools=tools, model=OpenAIResponsesModel(model=service.model, openai_client=client),
                  model_settings=model_settings)
    try:
        result = await Runner.run(agent, question, max_turns=4)
    except Exception as exc:  # noqa: BLE001 - an agent that fails (turn limit, a refused call) is an untrainable episode
        await service.close(session, None, failure="agent_crash")
        print(f"episode {session['id']} failed: {type(exc).__name__}: {exc}")
        return None
    finally:
        await client.close()
    reward = reward_of(result.final_output, ground_truth)
    await service.close(session, reward)
    return reward


def demo_rows(seed: int) -> list[dict]:
    from recipes.demo.task import ArithSpec, generate_rows

    return generate_rows(2000, seed=seed, split="train", spec=ArithSpec.level(0))  # the demo policy's level


async def play(url: str, api_token: str | None, rows: list[dict], n: int, groups_at_once: int, max_groups: int | None,
               temperature: float = 1.0, max_tokens: int = 64, stop: asyncio.Event | None = None) -> list[list[float | None]]:
    """Play ``rows`` in groups of ``n`` sessions until the service goes away (the run ended),
    ``stop`` is set or ``max_groups`` are done; each group's rewards, in completion order."""
    set_tracing_disabled(True)  # the SDK would export traces to OpenAI
    service, tools = Service(url, api_token), sdk_tools()
    settings = ModelSettings(temperature=temperature, max_tokens=max_tokens)
    stop, done, queue = stop or asyncio.Event(), [], asyncio.Queue()
    await service.served_model()
    failures = 0
    for i, row in enumerate(rows if max_groups is None else rows[:max_groups]):
        queue.put_nowait((i, row))

    async def worker() -> None:
        while not stop.is_set() and not queue.empty():
            i, row = queue.get_nowait()
            question = row["prompt"][-1]["content"]
            truth = str(row["reward_model"]["ground_truth"])
            sessions = [await service.open(f"q{i}", n, k, row.get("data_source", "agents-sdk/arith"), stop) for k in range(n)]
            if any(s is None for s in sessions):
                return
            rewards = await asyncio.gather(*(episode(service, s, question, truth, tools, settings) for s in sessions))
            done.append(list(rewards))
            nonlocal failures
            failures += rewards.count(None)
            if failures > 4 * n and failures > sum(len(g) for g in done) // 2:
                raise RuntimeError(f"{failures} of {sum(len(g) for g in done)} episodes failed: see the lines above")
            print(f"group q{i}: rewards {rewards}", flush=True)

    try:
        await asyncio.gather(*(worker() for _ in range(groups_at_once)))
    finally:
        await service.http.aclose()
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-token", default=None)
    ap.add_argument("--data", default=None, help="verl-layout JSONL (prompt, reward_model.ground_truth); default: the demo task")
    ap.add_argument("--n", type=int, default=8, help="sessions per group (GRPO's n)")
    ap.add_argument("--groups-at-once", type=int, default=4)
    ap.add_argument("--groups", type=int, default=None, help="stop after this many groups (default: until the run ends)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rows = [json.loads(line) for line in Path(a.data).read_text().splitlines() if line.strip()] if a.data else demo_rows(a.seed)
    groups = asyncio.run(play(a.url, a.api_token, rows, a.n, a.groups_at_once, a.groups, a.temperature))
    scored = [r for g in groups for r in g if r is not None]
    print(json.dumps({"groups": len(groups), "episodes": len(scored), "mean_reward": sum(scored) / max(1, len(scored))}))


if __name__ == "__main__":
    main()
