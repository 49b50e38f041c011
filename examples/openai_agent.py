"""An external agent written with the official OpenAI SDK, trained by asyncrl.

It opens a session on the rollout service, solves one arithmetic question with a
calculator tool it executes itself, sets the reward and finishes the session — which
publishes the episode (exact tokens and logprobs) to the trainer.

    python examples/openai_agent.py --url http://127.0.0.1:8000 [--api-token T] [--question "What is 12 * 7?"]

Requires only ``openai`` and ``httpx`` (both in the dev extra). Prints the session's final state as JSON.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re
import time

import httpx
from openai import OpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression exactly as written and return the number.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """A tiny safe arithmetic evaluator (no eval)."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError("unsupported expression")
    try:
        value = walk(ast.parse(expression, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"Error: {exc}"
    return str(int(value)) if float(value).is_integer() else str(value)


def open_session(url: str, headers: dict, attempts: int = 12) -> dict:
    """A new session; a 429 or 503 (the service paused for a weight sync, or its staleness quota
    full) is waited out as its ``Retry-After`` says, as the OpenAI SDK does for its own calls."""
    for _ in range(attempts):
        r = httpx.post(f"{url}/v1/sessions", json={"data_source": "example/openai-agent"}, headers=headers, timeout=30)
        if r.status_code not in (429, 503):
            r.raise_for_status()
            return r.json()
        after = r.headers.get("Retry-After", "1")
        time.sleep(min(float(after), 5.0) if after.replace(".", "", 1).isdigit() else 1.0)  # seconds, or an HTTP date
    r.raise_for_status()
    raise AssertionError("unreachable")


def run_episode(url: str, api_token: str | None, question: str, answer: str | None, max_turns: int = 3) -> dict:
    headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
    session = open_session(url, headers)
    client = OpenAI(base_url=session["base_url"], api_key=session["token"], timeout=300)
    model = client.models.list().data[0].id  # the served name (an unknown model is a 404, as with OpenAI)
    messages = [{"role": "user", "content": question}]
    for _ in range(max_turns):
        resp = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], temperature=0,
                                              max_tokens=64, logprobs=True)
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(args.get("expression", "")))})
    final = messages[-1].get("content") or ""
    boxed = re.findall(r"\\boxed\{([^}]*)\}", final)
    reward = float(bool(answer is not None and boxed and boxed[-1].strip() == answer))
    auth = {"Authorization": f"Bearer {session['token']}"}
    httpx.post(f"{url}/v1/sessions/{session['id']}/reward", json={"reward": reward}, headers=auth, timeout=30).raise_for_status()
    done = httpx.post(f"{url}/v1/sessions/{session['id']}/finish", headers=auth, timeout=30)
    done.raise_for_status()
    return done.json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-token", default=None)
    ap.add_argument("--question", default="What is 12 * 7? Use the calculator tool, then answer with \\boxed{N}.")
    ap.add_argument("--answer", default="84")
    args = ap.parse_args()
    print(json.dumps(run_episode(args.url, args.api_token, args.question, args.answer), indent=2))


if __name__ == "__main__":
    main()
