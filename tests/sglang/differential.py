"""One request sequence for local_engine and real SGLang (issue 45 item 7): every route asyncrl
uses, the bad inputs it relies on being refused, and its edge cases, observed the same way on
both so that a test can compare them (tests/sglang/test_differential.py).

``observe(url, api_key, admin_key)`` sends :data:`CASES` in order (they share the server's state:
a pause is followed by its continue) and returns one :class:`Observation` per case: the status
code, the set of top-level fields of a JSON answer (and of ``meta_info`` / ``error``), and the
error's class (its JSON shape, or ``text`` for a plain body), and, for a generation that answered,
its values (:attr:`Observation.values`: the tokens, their log-probs, the weight-version spans),
which a test compares with a tolerance on the log-probs (both engines run the same float32
weights; their numerics differ by ~1e-6). ``python -m tests.sglang.differential URL_A URL_B``
prints both side by side.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import httpx

PROMPT = [1, 5, 6, 7, 9]
# The /server_info fields asyncrl reads (asyncrl/engine_client, asyncrl/sync_control, the pool).
SERVER_INFO_READ = ("version", "tp_size", "dp_size", "pp_size", "enable_dp_attention", "weight_version",
                    "context_length", "max_total_num_tokens", "enable_lora", "max_lora_rank", "lora_target_modules",
                    "max_loaded_loras", "max_loras_per_batch", "lora_paths", "sampling_mask_max_tokens", "served_model_name",
                    "model_path", "max_req_input_len")
GEN = {"max_new_tokens": 4, "temperature": 0}


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: object = None
    auth: str = "admin"
    """``none``: no key; ``api``: the API key; ``admin``: the admin key (admin routes), ``wrong``: a wrong key."""
    only: tuple[str, ...] | None = None
    """Compare only these fields (an answer with hundreds of fields asyncrl does not read)."""


CASES: tuple[Case, ...] = (
    # auth
    Case("health without a key", "GET", "/health", auth="none"),
    Case("an unknown route", "GET", "/no_such_route", auth="api"),
    Case("model_info without a key", "GET", "/model_info", auth="none"),
    Case("model_info with a wrong key", "GET", "/model_info", auth="wrong"),
    Case("generate without a key", "POST", "/generate", {"input_ids": PROMPT, "sampling_params": GEN}, auth="none"),
    Case("pause with the API key only", "POST", "/pause_generation", {"mode": "abort"}, auth="api"),
    # info
    Case("model_info", "GET", "/model_info", auth="api"),
    Case("server_info", "GET", "/server_info", auth="api", only=SERVER_INFO_READ),
    Case("v1/loads", "GET", "/v1/loads", auth="api"),
    Case("get_load (v1/loads' older alias)", "GET", "/get_load", auth="api"),
    Case("weight_version", "GET", "/get_weight_version", auth="api"),
    Case("health_generate", "GET", "/health_generate", auth="api"),
    # generate
    Case("generate by ids with logprobs", "POST", "/generate",
         {"rid": "diff-1", "input_ids": PROMPT, "sampling_params": GEN, "return_logprob": True}, auth="api"),
    Case("generate by text", "POST", "/generate", {"text": "1 + 2 =", "sampling_params": GEN}, auth="api"),
    Case("generate a batch of two", "POST", "/generate",
         {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": GEN, "return_logprob": True}, auth="api"),
    Case("generate with stop token ids", "POST", "/generate",
         {"input_ids": PROMPT, "sampling_params": {**GEN, "stop_token_ids": [2]}}, auth="api"),
    Case("generate with top_k and top_p", "POST", "/generate",
         {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "top_k": 5, "top_p": 0.9},
          "return_logprob": True}, auth="api"),
    Case("generate asking for top logprobs", "POST", "/generate",
         {"input_ids": PROMPT, "sampling_params": GEN, "return_logprob": True, "top_logprobs_num": 2}, auth="api"),
    Case("generate with max_new_tokens 0", "POST", "/generate",
         {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}}, auth="api"),
    # bad generate input
    Case("generate with neither text nor ids", "POST", "/generate", {"sampling_params": GEN}, auth="api"),
    Case("generate with both text and ids", "POST", "/generate",
         {"text": "x", "input_ids": PROMPT, "sampling_params": GEN}, auth="api"),
    Case("generate with an unknown sampling param", "POST", "/generate",
         {"input_ids": PROMPT, "sampling_params": {**GEN, "no_such_param": 1}}, auth="api"),
    Case("generate with a negative temperature", "POST", "/generate",
         {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": -1}}, auth="api"),
    Case("generate with top_p 0", "POST", "/generate",
         {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "top_p": 0}}, auth="api"),
    Case("generate with a negative max_new_tokens", "POST", "/generate",
         {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}}, auth="api"),
    Case("generate longer than the context", "POST", "/generate",
         {"input_ids": [5] * 1100, "sampling_params": GEN}, auth="api"),
    Case("generate with an empty prompt", "POST", "/generate", {"input_ids": [], "sampling_params": GEN}, auth="api"),
    Case("generate with a body that is not JSON", "POST", "/generate", b"{not json", auth="api"),
    Case("generate naming a LoRA adapter with LoRA off", "POST", "/generate",
         {"input_ids": PROMPT, "sampling_params": GEN, "lora_path": "nope"}, auth="api"),
    # pause / abort / flush
    Case("abort an unknown rid", "POST", "/abort_request", {"rid": "no-such-rid"}),
    Case("abort all", "POST", "/abort_request", {"abort_all": True}),
    Case("pause in_place", "POST", "/pause_generation", {"mode": "in_place"}),
    Case("continue", "POST", "/continue_generation", {}),
    Case("pause retract", "POST", "/pause_generation", {"mode": "retract"}),
    Case("flush while paused and idle", "POST", "/flush_cache", None),
    Case("continue again", "POST", "/continue_generation", {}),
    Case("pause with an unknown mode", "POST", "/pause_generation", {"mode": "sideways"}),
    Case("flush when idle", "POST", "/flush_cache", None),
    # weights
    Case("weights_checker checksum", "POST", "/weights_checker", {"action": "checksum"}),
    Case("weights_checker unknown action", "POST", "/weights_checker", {"action": "explode"}),
    Case("end a weight session never begun", "POST", "/end_weight_update", {}),
    Case("destroy an unknown weight group", "POST", "/destroy_weights_update_group", {"group_name": "diff"}),
    Case("update from disk at a missing path", "POST", "/update_weights_from_disk",
         {"model_path": "/nonexistent/model", "weight_version": "9"}),
    Case("update the weight version", "POST", "/update_weight_version", {"new_version": "7", "abort_all_requests": False}),
    Case("weight version after the update", "GET", "/get_weight_version", auth="api"),
    # LoRA with LoRA off
    Case("load a LoRA adapter with LoRA off", "POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent"}),
    Case("unload an unknown adapter", "POST", "/unload_lora_adapter", {"lora_name": "a"}),
)
FATAL: tuple[Case, ...] = (
    # sent last, in this order: each kills SGLang's server on some releases (an exception in the
    # scheduler is not caught), and local_engine with --sglang-fatal-errors must die on the same;
    # after a death every later case finds no server on both
    # up to 0.5.20 the scheduler looks the group up unchecked (0.5.21+: 400, outside a session)
    Case("update from distributed outside a session", "POST", "/update_weights_from_distributed",
         {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "group_name": "diff"}),
    # every release: the embedding lookup raises
    Case("generate with a token id outside the vocabulary", "POST", "/generate",
         {"input_ids": [1, 10_000_000], "sampling_params": GEN}, auth="api"),
)


@dataclass(frozen=True)
class Observation:
    name: str
    status: int
    fields: tuple[str, ...]
    """Top-level JSON fields (a list answer: its first element's), plus ``meta_info.*`` / ``error.*``."""
    kind: str
    """``json-object``, ``json-list``, ``json-other``, ``text``, ``empty`` or ``no-answer`` (status 0:
    the connection closed without an answer, or the server is gone)."""
    values: dict | None = field(default=None, compare=False)
    """A generation's ``output_ids``, ``logprobs`` (of ``output_token_logprobs``) and
    ``weight_versions`` (None: not a generation, or no answer). Left out of ``==``: compared
    with a tolerance (:func:`value_problems`)."""

    def line(self) -> str:
        return f"{self.status} {self.kind} {','.join(self.fields)}"


def _fields(body: object) -> tuple[str, ...]:
    obj = body[0] if isinstance(body, list) and body and isinstance(body[0], dict) else body
    if not isinstance(obj, dict):
        return ()
    out = set(obj)
    for inner in ("meta_info", "error"):
        if isinstance(obj.get(inner), dict):
            out |= {f"{inner}.{k}" for k in obj[inner]}
    return tuple(sorted(out))


def _values(body: object) -> dict | None:
    if not isinstance(body, dict) or not isinstance(body.get("output_ids"), list):
        return None
    meta = body.get("meta_info") or {}
    lps = meta.get("output_token_logprobs")
    return {"output_ids": body["output_ids"], "logprobs": [t[0] for t in lps] if isinstance(lps, list) else None,
            "weight_versions": meta.get("weight_versions")}


def value_problems(a: Observation, b: Observation, tolerance: float = 1e-4) -> list[str]:
    """How two observations of one case differ in value (empty: alike, or nothing to compare)."""
    if a.values is None or b.values is None:
        return [] if a.values is b.values else [f"values only on one side: {a.values is not None} / {b.values is not None}"]
    out = []
    if a.values["output_ids"] != b.values["output_ids"]:
        out.append(f"output_ids {a.values['output_ids']} / {b.values['output_ids']}")
    la, lb = a.values["logprobs"], b.values["logprobs"]
    if (la is None) != (lb is None) or (la is not None and (len(la) != len(lb) or any(abs(x - y) > tolerance
                                                                                   for x, y in zip(la, lb)))):
        out.append(f"logprobs {la} / {lb}")
    if a.values["weight_versions"] != b.values["weight_versions"]:
        out.append(f"weight_versions {a.values['weight_versions']} / {b.values['weight_versions']}")
    return out


def observe(url: str, api_key: str, admin_key: str, cases: tuple[Case, ...] = CASES, timeout_s: float = 60.0,
            progress=lambda obs: None) -> list[Observation]:
    keys = {"none": None, "api": api_key, "admin": admin_key, "wrong": "wrong-key-0123456789"}
    out = []
    # a connection per request: a server that failed a request with an unhandled exception closes
    # its connection, which a reused keep-alive connection would report as this request's error
    with httpx.Client(base_url=url, timeout=timeout_s, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        for case in cases:
            key = keys[case.auth]
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            try:
                if isinstance(case.body, bytes):
                    resp = http.request(case.method, case.path, content=case.body,
                                        headers={**headers, "Content-Type": "application/json"})
                else:
                    resp = http.request(case.method, case.path, json=case.body, headers=headers)
            except httpx.TransportError as exc:  # the server closed the connection or is gone
                out.append(Observation(case.name, 0, (type(exc).__name__,), "no-answer"))
                progress(out[-1])
                continue
            try:
                body = resp.json()
                kind = "json-object" if isinstance(body, dict) else "json-list" if isinstance(body, list) else "json-other"
            except (json.JSONDecodeError, ValueError):
                body, kind = None, "text" if resp.content else "empty"
            fields = _fields(body)
            if case.only is not None:
                fields = tuple(f for f in fields if f in case.only)
            out.append(Observation(case.name, resp.status_code, fields, kind, _values(body) if case.path == "/generate" else None))
            progress(out[-1])
    return out


def main(argv: list[str]) -> int:
    a_url, b_url, api_key, admin_key = argv[0], argv[1], argv[2], argv[3]
    for a, b in zip(observe(a_url, api_key, admin_key), observe(b_url, api_key, admin_key), strict=True):
        mark = "  " if a == b else "!="
        print(f"{mark} {a.name}\n     A: {a.line()}\n     B: {b.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
