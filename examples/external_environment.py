"""An external environment in plain HTTP: it serves a tool declared ``external`` in the
run's config (``rollout.external_tools``) for asyncrl's internal agents.

    python examples/external_environment.py --url http://127.0.0.1:8000 --environment default [--api-token T]

It long-polls ``GET /v1/environments/{env}/tool_calls?wait=10`` (data-plane token), computes
each parked call (here: arithmetic, like a calculator living outside the service) and posts
the answer to ``POST /v1/sessions/{id}/tool_results`` with the call's own token. Posting is
idempotent: a retried post of the same result is accepted once. Runs until Ctrl-C, or for
``--max-calls`` calls. Only needs ``httpx``.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
import time

import httpx

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def compute(expression: str) -> str:
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError("unsupported expression")
    try:
        return str(walk(ast.parse(expression, mode="eval")))
    except (SyntaxError, ValueError) as exc:
        return f"Error: {exc}"


def serve(url: str, environment: str, api_token: str | None, max_calls: int | None, wait_s: float = 10.0) -> int:
    headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
    served: set[tuple[str, str]] = set()
    with httpx.Client(timeout=wait_s + 30) as http:
        while max_calls is None or len(served) < max_calls:
            resp = http.get(f"{url}/v1/environments/{environment}/tool_calls", params={"wait": wait_s}, headers=headers)
            resp.raise_for_status()
            for call in resp.json()["tool_calls"]:
                key = (call["session_id"], call["tool_call_id"])
                if key in served:
                    continue
                result = compute(str(call["arguments"].get("expression", "")))
                post = http.post(f"{url}/v1/sessions/{call['session_id']}/tool_results",
                                 json={"tool_call_id": call["tool_call_id"], "content": result},
                                 headers={"Authorization": f"Bearer {call['token']}"})
                print(json.dumps({"call": call["tool_call_id"], "session": call["session_id"], "result": result,
                                  "status": post.status_code, "answer": post.json()}), flush=True)
                served.add(key)
            time.sleep(0.05)
    return len(served)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--environment", default="default")
    ap.add_argument("--api-token", default=None)
    ap.add_argument("--max-calls", type=int, default=None)
    args = ap.parse_args()
    try:
        serve(args.url, args.environment, args.api_token, args.max_calls)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
