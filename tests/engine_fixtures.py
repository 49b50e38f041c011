"""Real local_engine processes for tests: free port on 127.0.0.1, bounded startup, stopped at teardown.

Used by tests/local_engine and tests/engine_client (their conftests put this directory on
sys.path). Each engine runs ``python -m local_engine --model builtin:tiny`` with one torch
thread and logs to the test's tmp dir; a failed start raises with the log tail.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.launch import ChildProcess, free_port, http_ok

# Importing torch + transformers and building builtin:tiny takes 5-15 s on a busy 2-core box.
ENGINE_START_TIMEOUT_S = 120.0
# Per-call limit the tests' clients use: generous for a loaded CI box, still bounded.
CLIENT_TIMEOUT_S = 60.0
MODEL = "builtin:tiny"
SEED = 0


@dataclass
class EngineProc:
    """A running engine: its URL, keys and process."""

    url: str
    port: int
    child: ChildProcess
    api_key: str | None = None
    admin_api_key: str | None = None

    def client(self, **kw):
        from asyncrl.engine_client import EngineClient

        kw.setdefault("request_timeout_s", CLIENT_TIMEOUT_S)
        kw.setdefault("control_timeout_s", CLIENT_TIMEOUT_S)
        return EngineClient(self.url, api_key=self.api_key, admin_api_key=self.admin_api_key, **kw)


@contextmanager
def running_engine(log_dir: Path, *extra: str, api_key: str | None = None, admin_api_key: str | None = None,
                   name: str = "engine", env: dict[str, str] | None = None) -> Iterator[EngineProc]:
    """Start an engine, wait for /health, yield it, stop it (SIGTERM, then SIGKILL)."""
    port = free_port()
    argv = [sys.executable, "-m", "local_engine", "--model", MODEL, "--seed", str(SEED), "--host", "127.0.0.1",
            "--port", str(port), "--torch-threads", "1", "--log-level", os.environ.get("LOCAL_ENGINE_TEST_LOG_LEVEL", "warning"), *extra]
    extra_env = env
    env = dict(os.environ)
    env.pop("LOCAL_ENGINE_API_KEY", None)
    env.pop("LOCAL_ENGINE_ADMIN_API_KEY", None)
    if api_key:
        env["LOCAL_ENGINE_API_KEY"] = api_key
    if admin_api_key:
        env["LOCAL_ENGINE_ADMIN_API_KEY"] = admin_api_key
    env.update(extra_env or {})
    child = ChildProcess(name, argv, Path(log_dir) / f"{name}-{port}.log", env=env)
    child.start()
    url = f"http://127.0.0.1:{port}"
    try:
        child.wait_ready(lambda: http_ok(f"{url}/health"), ENGINE_START_TIMEOUT_S)
        yield EngineProc(url=url, port=port, child=child, api_key=api_key, admin_api_key=admin_api_key)
    finally:
        child.stop()


def load_reference_model():
    """The engine's model, built in this process (same spec and seed), float32, eval."""
    from asyncrl.models import load_model

    return load_model(MODEL, dtype="float32", seed=SEED)


@torch.inference_mode()
def teacher_forced_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each output token given prompt + the outputs before it."""
    if not output:
        return []
    ids = torch.tensor([prompt + output])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1].float()
    t = 1.0 if temperature < 1e-6 else temperature
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1).tolist()


@torch.inference_mode()
def greedy_continuation(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of ``model`` after ``prompt`` (no EOS stop), by full forward passes."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
