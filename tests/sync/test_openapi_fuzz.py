"""Each service's OpenAPI document against the service itself: schemathesis (its CLI, pinned in
the dev extras) generates requests from ``/openapi.json`` — valid ones, boundary values and
invalid ones — sends them to a real local_engine, rollout service and sync agent wired
together, and fails on any 5xx (``not_a_server_error``) or any status the document does not
list for the operation (``status_code_conformance``).

The number of examples is bounded (``MAX_EXAMPLES`` per operation, ``MAX_TIME_S`` per run,
a fixed seed). Excluded, because they hold the service in a state the other operations would
then wait on, and each has its own tests: the engine's ``/pause_generation`` (parks all
generation until continued), ``/init_weights_update_group`` and
``/update_weights_from_distributed`` (join a collective and wait for the peers the body
names), the sync agent's ``POST /v1/syncs`` (pauses the rollout and starts a broadcast), the
rollout's ``POST /admin/pause`` (stops the data plane being fuzzed beside it) and its routes on
one engine, ``/admin/engines/{engine_id}`` and ``.../quarantine``: schemathesis learns the real
engine's id from ``/admin/status`` answers and quarantines or removes it, and the data plane
fuzzed beside it then has no engine (its calls wait up to 30 s for one, each retried).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.helpers.processes import start_engine
from tests.rollout.conftest import ADMIN
from tests.sync.conftest import SYNC_TOKEN, stack

API = "data-plane-token-0123456789"
MAX_EXAMPLES = 10
MAX_TIME_S = 30
RUN_TIMEOUT_S = MAX_TIME_S + 120  # the CLI's own start and report, on a busy machine
FUZZ_CONTEXT = 64  # the engine run's context: no /generate decodes more than this
MAX_TOKENS = 32  # the rollout's largest (and default) completion
CHECKS = "not_a_server_error,status_code_conformance"
SCHEMATHESIS = str(Path(sys.executable).with_name("schemathesis"))


async def fuzz(url: str, token: str | None, tmp_path: Path, *selection: str) -> str:
    args = [SCHEMATHESIS, "run", f"{url}/openapi.json", "--checks", CHECKS, "--max-examples", str(MAX_EXAMPLES),
            "--seed", "7", "--max-time", str(MAX_TIME_S), "--request-timeout", "60", "--phases", "examples,coverage,fuzzing",
            "--suppress-health-check", "all", "--no-color", *selection]
    if token:
        args += ["-H", f"Authorization: Bearer {token}"]
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                cwd=tmp_path)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        raise
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"schemathesis against {url} {' '.join(selection)} failed:\n{text[-8000:]}"
    return text


async def test_every_service_answers_as_its_openapi_document_says(tmp_path, nats_server):
    # Each request's cost is bounded so that none waits long behind another on a busy machine
    # (CI once timed out a chat completion at 60 s that asked for no max_tokens, so it decoded to
    # the context end, queued behind the engine run's boundary-value max_new_tokens): the
    # engine run has its own engine with a short context, and the rollout's completions are
    # capped by ``api.max_tokens`` (its default when a request names none).
    with start_engine(tmp_path, "--max-model-len", str(FUZZ_CONTEXT), name="engine-fuzz") as fuzzed, \
            start_engine(tmp_path, name="engine-rollout") as engine:
        async with stack(tmp_path, nats_server.url, [engine.url], f"security.api_token={API}", "rollout.total_rollout_steps=1",
                         "rollout.n=1", "actor.ppo_mini_batch_size=1", f"api.max_tokens={MAX_TOKENS}") as (svc, rollout_url, agent, agent_url, cfg):
            # left out: routes that stop the engine on purpose (a pause; a group join or a broadcast
            # waiting for peers; /slow_down, SGLang's test hook, which may make every forward sleep
            # up to an hour: /health then answers 503 as SGLang's does once it cannot generate)
            runs = [(fuzzed.url, None, ("--exclude-path-regex",
                                         "^/(pause_generation|init_weights_update_group|update_weights_from_distributed"
                                         "|slow_down)$")),
                    (rollout_url, API, ("--include-path-regex", "^/(v1/|health|metrics)")),
                    (rollout_url, ADMIN, ("--include-path-regex", "^/admin/", "--exclude-path", "/admin/pause",
                                          "--exclude-path-regex", "^/admin/engines/\\{engine_id\\}")),
                    (agent_url, SYNC_TOKEN, ("--exclude-name", "POST /v1/syncs"))]
            dirs = [tmp_path / f"fuzz-{i}" for i in range(len(runs))]
            for d in dirs:
                d.mkdir()
            # the four runs at once (each mostly waits on HTTP): a quarter of the wall time
            reports = await asyncio.gather(*(fuzz(url, token, d, *sel) for (url, token, sel), d in zip(runs, dirs)))
    for report in reports:
        assert "passed" in report.lower(), report[-2000:]
