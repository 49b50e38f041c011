"""Issue 47, second part: a streamed session turn must record exactly the engine's tokens.

Once, an acceptance check found a session's trajectory ending in a byte-fallback token (mask 1,
a log-prob, version 0) that the check's recording proxy had not seen the engine return. Here
many sessions run at once against one engine behind a recording proxy (real service, real
engine, the official async ``openai`` client), each of three turns — plain, after a tool
message, then streamed — sampled at temperature 1 so that byte-fallback tokens, split UTF-8
characters and held-back text occur often. Every published trajectory is then compared token
for token with the engine's answers (``tests.helpers.engine_exactness``): each call's input
a prefix of the trajectory, its output the next tokens with mask 1, its log-probs and
versions; every mask-1 token from exactly one call; each session made exactly three answered
calls, none of them taken back. What each stream sent its client must equal the turn's text
in the trajectory.
"""

from __future__ import annotations

import asyncio
import json

from openai import AsyncOpenAI

from asyncrl.chat import ChatTokenizer
from asyncrl.engine_client.types import GenerateResult
from asyncrl.models import load_tokenizer
from rollout_service.agent.tool_parser import parse_hermes
from tests.helpers.engine_exactness import mismatches
from tests.helpers.recording_proxy import RecordingProxy
from tests.rollout.conftest import running_service
from tests.rollout.test_openai_api import CALC, QUESTION, finish, idle_cfg, new_session
from tests.rollout.test_service_episodes import fetch_all

SESSIONS = 16  # at once: the service interleaves their engine calls and streams
MAX_TOKENS = 24


async def _session(url: str) -> tuple[str, list[str]]:
    """Three turns; returns the session id and what the streamed turn sent (content deltas)."""
    sess = await new_session(url, data_source="external/stream-exactness", group_size=1)
    client = AsyncOpenAI(base_url=sess["base_url"], api_key=sess["token"], timeout=300, max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    first = await client.chat.completions.create(model="policy", messages=messages, temperature=1.0,
                                                 max_tokens=MAX_TOKENS, logprobs=True)
    messages.append({"role": "assistant", "content": first.choices[0].message.content or ""})
    messages.append({"role": "user", "content": "Check it with the calculator."})
    second = await client.chat.completions.create(model="policy", messages=messages, tools=CALC, temperature=1.0,
                                                  max_tokens=MAX_TOKENS)
    msg = second.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
    if not msg.tool_calls:
        messages.append({"role": "user", "content": "Answer with \\boxed{N}."})
    stream = await client.chat.completions.create(model="policy", messages=messages, temperature=1.0,
                                                  max_tokens=MAX_TOKENS, stream=True, logprobs=True)
    deltas = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    await finish(url, sess, reward=0.0)
    return sess["id"], deltas


def last_segment(calls: list) -> list:
    """The trailing calls of a session whose inputs extend each other (each call's input and
    output a prefix of the next call's input): the session's last segment, by the engine's
    traffic alone."""
    out = calls[-1:]
    for req, res in reversed(calls[:-1]):
        done = req["input_ids"] + res.output_ids
        if out[0][0]["input_ids"][:len(done)] != done:
            break
        out.insert(0, (req, res))
    return out


async def test_many_streamed_session_turns_record_exactly_the_engines_tokens(tmp_path, nats_server, warm_engine, warm_model):
    proxy = await RecordingProxy(warm_engine).start()
    try:
        async with running_service(idle_cfg(tmp_path, nats_server.url, proxy.url)) as (_svc, url):
            done = await asyncio.gather(*(_session(url) for _ in range(SESSIONS)))
        trajs = await fetch_all(nats_server.url, "demo", SESSIONS + 1)  # the service's one internal trajectory too
    finally:
        await proxy.stop()
    chat = ChatTokenizer(load_tokenizer(str(warm_model)), CALC)
    by_id = {t.id: t for t in trajs}
    assert not proxy.undelivered, [req["rid"] for req, _ in proxy.undelivered]
    problems = {}
    for sid, deltas in done:
        traj = by_id[sid]
        calls = [(req, GenerateResult.parse(res)) for req, res in proxy.exchanges if f".{sid}." in req["rid"]]
        found = []
        if len(calls) != 3:
            found.append(f"{len(calls)} answered engine calls for three turns: {[req['rid'] for req, _ in calls]}")
        # the published trajectory is the session's last segment (a history that does not re-render
        # to the recorded tokens starts a new one): its calls are those whose input it extends
        mine = last_segment(calls)
        if not mine or mine[-1][0]["rid"] != calls[-1][0]["rid"]:
            found.append("the streamed turn's call is not in the published trajectory")
        found += mismatches(traj, mine)
        if mine:
            req, last = mine[-1]
            start = len(req["input_ids"])
            turn_text = chat.decode_turn(traj.token_ids[start:start + len(last.output_ids)])
            # what the stream sent is the turn's content, as a non-streamed answer gives it
            if "".join(deltas).strip() != parse_hermes(turn_text, 0).content:
                found.append(f"the stream sent {''.join(deltas)!r}, the trajectory's last turn reads {turn_text!r}")
        if found:
            problems[sid] = found
    assert not problems, json.dumps(problems, indent=1)[:4000]
