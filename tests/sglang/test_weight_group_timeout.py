"""Issue 66 N7: SGLang's side of the weight-update group is bounded by asyncrl's hook
(``launcher/sglang_hooks``, ``engines.weight_group_timeout_s``) instead of torch's 30 minutes.

The sender here is a group member that joined and then never sends: what a stalled trainer
rank (SIGSTOPped, a dead link) looks like to a receiver. Over gloo, as over NCCL, the receiver
then waits out its group's timeout, so these tests could not pass without the hook (they would
wait 30 minutes and fail at their own limits):

- SGLang's own ``init_custom_process_group`` (0.5.18 and 0.5.23), in the release's venv, with the
  hook's environment: the broadcast it receives in fails after the hook's timeout; without the
  variable the function is SGLang's, unwrapped (the slice);
- a whole SGLang 0.5.23 server: ``/update_weights_from_distributed`` answers a failure after the
  timeout, the server is still up, and it serves exactly what it served before (greedy tokens and
  their log-probs equal).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time

import pytest

from asyncrl.launch import free_port
from asyncrl.weight_sync import host_group
from launcher.sglang_hooks import TIMEOUT_ENV
from tests.sglang.conftest import ADMIN_KEY, API_KEY, DEMO_MODEL, OLDER_RELEASE, SLICE
from tests.sglang_cpu.install import DEFAULT_RELEASE, venv_python
from tests.sglang_cpu.server import server_env, start_sglang

TIMEOUT_S = 4.0
ENOUGH_S = 120.0  # far below torch's 30 minutes, far above the bound plus a loaded machine's delays

RECEIVER = """
import json, sys, time, torch
import torch.distributed as dist
from sglang.srt.utils.common import init_custom_process_group
port = int(sys.argv[1])
bounded = getattr(init_custom_process_group, "__asyncrl_bounded__", False)
if sys.argv[2] == "probe":
    print(json.dumps({"bounded": bounded}))
    sys.exit(0)
pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                               group_name="n7")
started = time.monotonic()
try:
    dist.broadcast(torch.empty(4), src=0, group=pg)
    error = None
except Exception as exc:
    error = str(exc)
print(json.dumps({"bounded": bounded, "error": error, "waited_s": time.monotonic() - started}))
"""


def _receiver(release: str, port: int, mode: str, env_extra: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([str(venv_python(release)), "-c", RECEIVER, str(port), mode], env=server_env(1, env_extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=ENOUGH_S + 60)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("release", [pytest.param(DEFAULT_RELEASE, marks=getattr(pytest.mark, SLICE)), OLDER_RELEASE])
def test_the_hook_bounds_sglangs_own_weight_group(release):
    """SGLang's function, in its own venv: with the variable, a receive from a sender that never
    sends ends after the timeout; with an empty variable, the function is left as SGLang wrote it."""
    plain = _receiver(release, 1, "probe", {TIMEOUT_ENV: ""})
    assert _result(plain) == {"bounded": False}
    port = free_port()
    proc = _receiver(release, port, "receive", {TIMEOUT_ENV: f"{TIMEOUT_S:g}"})
    sender = host_group("127.0.0.1", port, 2, group_name="n7", timeout_s=ENOUGH_S)  # joins, then stalls
    try:
        got = _result(proc)
    finally:
        sender.destroy()
    assert got["bounded"] is True and got["error"], got
    assert TIMEOUT_S - 0.5 <= got["waited_s"] <= ENOUGH_S, got


PROMPT = [5, 17, 42, 99, 7, 300, 12]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


async def test_a_server_waiting_on_a_stalled_sender_fails_the_update_after_the_bound(tmp_path):
    """A whole server with the hook as the product starts it: the update waiting on a stalled
    sender answers a failure after ``weight_group_timeout_s``; the engine keeps serving the
    weights it had (tokens and log-probs equal to before)."""
    with start_sglang(tmp_path, DEMO_MODEL, api_key=API_KEY, admin_api_key=ADMIN_KEY,
                      env={TIMEOUT_ENV: f"{TIMEOUT_S:g}"}) as engine:
        async with engine.client() as c:
            config = json.loads((DEMO_MODEL / "config.json").read_text())
            before = await c.generate(PROMPT, GREEDY)
            info = await c.server_info()
            port, holder = free_port(), {}
            hosting = threading.Thread(target=lambda: holder.update(g=host_group(
                "127.0.0.1", port, 1 + info.get("tp_size", 1), group_name="n7", timeout_s=ENOUGH_S)), daemon=True)
            hosting.start()
            await c.pause("abort")
            session = await c.begin_weight_update()
            await c.init_weights_update_group("127.0.0.1", port, 1, 1 + info.get("tp_size", 1), group_name="n7")
            hosting.join(ENOUGH_S)
            try:
                started = time.monotonic()
                with pytest.raises(Exception) as failed:  # noqa: PT011 - the engine's answer, checked below
                    await asyncio.wait_for(c.update_weights_from_distributed(
                        ["model.embed_tokens.weight"], ["float32"], [[config["vocab_size"], config["hidden_size"]]], group_name="n7",
                        weight_version=1, timeout_s=ENOUGH_S), ENOUGH_S)
                waited = time.monotonic() - started
            finally:
                holder["g"].destroy()
            assert "Failed to receive weights" in str(failed.value), failed.value
            assert TIMEOUT_S - 0.5 <= waited < ENOUGH_S
            if session:
                await c.end_weight_update()
            await c.resume()
            after = await c.generate(PROMPT, GREEDY)
    assert after.output_ids == before.output_ids
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-6) and len(after.logprobs) == GREEDY["max_new_tokens"]
