"""Real SGLang servers on this CPU, for the real-SGLang test tier (``./dev test-sglang``).

``start_sglang(log_dir, model_dir, *extra, release=..., port=..., api_key=..., admin_api_key=...,
lora=..., tp_size=..., env=..., name=...)`` runs ``python -m sglang.launch_server`` from the
release's venv (``install.venv_python``: built on first use) with :func:`cpu_flags`, waits for
``/health`` (SGLang's own readiness: the model loaded, the scheduler answering) and returns a
``tests.helpers.processes.Engine`` (URL, keys, the process group), so a test drives it exactly as
it drives a local_engine. The server's whole log (SGLang's server args included) is
``<log_dir>/<name>-<port>.log``.

The process gets ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU code paths), ``HF_HUB_OFFLINE=1`` (no
hub), asyncrl's own hook first on ``PYTHONPATH`` as the product gives it to SGLang
(``launcher/sglang_hooks``: the weight group's timeout, ``engines.weight_group_timeout_s``'s
default unless ``env`` says otherwise) and then ``stand_ins/``: the ``sgl_kernel`` stand-in (one function in
plain torch, every other name fails when used) and a ``sitecustomize`` that drops
``pin_memory`` without CUDA (LoRA asks for it). They are what they say and no more:
stand_ins/sgl_kernel/__init__.py and stand_ins/sitecustomize.py.

``tp_size`` > 1 binds one core per rank (``SGLANG_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from asyncrl.config.run_config import RunConfig
from asyncrl.launch import ChildProcess, free_port
from launcher.sglang_hooks import hook_env
from tests.helpers.processes import Engine
from tests.sglang_cpu.install import DEFAULT_RELEASE, venv_python

STAND_INS = Path(__file__).resolve().parent / "stand_ins"
DEFAULT_WEIGHT_GROUP_TIMEOUT_S = RunConfig().engine_weight_group_timeout_s
# Import of torch + SGLang + the model in three processes: 20-40 s idle, several times that with
# the suite's other work on the 2 cores.
START_TIMEOUT_S = 300.0
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


STAND_IN_CALLED = "NotImplementedError: sgl_kernel stand-in:"
"""What a server's log holds when SGLang called a kernel the stand-in only names (issue 66 W5)."""


class SglangServer(Engine):
    """A real SGLang server; leaving its ``with`` block stops it and fails the test if SGLang
    called a stand-in kernel meanwhile (a code path these CPU runs cannot vouch for)."""

    def __exit__(self, *exc) -> None:
        self.stop()
        if exc[0] is None:
            assert_no_stand_in_called(self.proc.log_path)


def assert_no_stand_in_called(log_path: Path) -> None:
    text = Path(log_path).read_text(errors="replace") if Path(log_path).exists() else ""
    hits = [line for line in text.splitlines() if STAND_IN_CALLED in line]
    assert not hits, f"SGLang called a stand-in kernel ({log_path}): {hits[0]}"


def cpu_flags(*, context_length: int = 1024, max_total_tokens: int = 8192) -> list[str]:
    """The launch flags SGLang needs on a CPU without its kernel library: torch-native attention
    (norms, activations and sampling then take plain-torch paths), no CUDA graphs, no grammar
    backend, a small KV pool, no warm-up request."""
    return ["--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--mem-fraction-static", "0.05", "--max-total-tokens", str(max_total_tokens),
            "--context-length", str(context_length), "--grammar-backend", "none", "--skip-server-warmup", "--sleep-on-idle"]


def lora_flags(rank: int, *, max_loaded_loras: int = 8, max_loras_per_batch: int = 8,
               targets: tuple[str, ...] = LORA_TARGETS) -> list[str]:
    """``--enable-lora`` with the torch-native backend (``all`` as target fails in SGLang's
    embedding LoRA layer on the CPU: name the projections)."""
    return ["--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", str(rank),
            "--lora-target-modules", *targets, "--max-loaded-loras", str(max_loaded_loras),
            "--max-loras-per-batch", str(max_loras_per_batch)]


def server_env(tp_size: int = 1, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "PYTHON"))}
    env.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               # asyncrl's hook first, as the product starts SGLang (compose, Slurm): it loads the
               # stand-ins' sitecustomize after its own
               **hook_env(DEFAULT_WEIGHT_GROUP_TIMEOUT_S, python_path=str(STAND_INS)), TOKENIZERS_PARALLELISM="false",
               # one compute thread per process: OpenMP's spinning threads of several servers and the
               # trainer on 2 cores made a decode step of the tiny model take seconds
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if tp_size > 1:
        cores = os.cpu_count() or 1
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp_size))
    env.update(extra or {})
    return env


def healthy(url: str, api_key: str | None = None, timeout_s: float = 2.0) -> bool:
    """GET /health answers 2xx (with the key when the server has one)."""
    req = urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - a loopback URL we built
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_sglang(log_dir: Path | str, model_dir: Path | str, *extra: str, release: str = DEFAULT_RELEASE,
                 port: int | None = None, api_key: str | None = None, admin_api_key: str | None = None,
                 tp_size: int = 1, env: dict[str, str] | None = None, name: str = "sglang",
                 timeout_s: float = START_TIMEOUT_S) -> Engine:
    """Start one real SGLang server on the CPU and wait until it serves (module docstring)."""
    (engine,) = start_sglang_servers(log_dir, model_dir, *extra, count=1, release=release, ports=[port] if port else None,
                                     api_key=api_key, admin_api_key=admin_api_key, tp_size=tp_size, env=env, name=name,
                                     timeout_s=timeout_s)
    return engine


def start_sglang_servers(log_dir: Path | str, model_dir: Path | str, *extra: str, count: int, release: str = DEFAULT_RELEASE,
                         ports: list[int] | None = None, api_key: str | None = None, admin_api_key: str | None = None,
                         tp_size: int = 1, env: dict[str, str] | None = None, name: str = "sglang",
                         timeout_s: float = START_TIMEOUT_S) -> list[Engine]:
    """``count`` servers started together (their start-ups overlap), each named ``<name>-<i>``
    (``<name>`` alone when ``count`` is 1); all stopped if any fails to start."""
    python = venv_python(release)
    ports = ports or [free_port() for _ in range(count)]
    engines = []
    for i, port in enumerate(ports):
        argv = [str(python), "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
                "--port", str(port), "--tp-size", str(tp_size), "--random-seed", "0", *cpu_flags(), *extra]
        if api_key:
            argv += ["--api-key", api_key]
        if admin_api_key:
            argv += ["--admin-api-key", admin_api_key]
        label = name if count == 1 else f"{name}-{i}"
        proc = ChildProcess(label, argv, Path(log_dir) / f"{label}-{port}.log", env=server_env(tp_size, env)).start()
        engines.append(SglangServer(url=f"http://127.0.0.1:{port}", port=port, proc=proc, api_key=api_key,
                              admin_api_key=admin_api_key))
    try:
        for engine in engines:
            engine.proc.wait_ready(lambda e=engine: healthy(e.url, api_key), timeout_s)
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines
