"""The trainer's step against a plain packed PyTorch loop on the same batch, uniform and long-tail
(issue 31): useful tokens/s, their ratio, the share of processed tokens that is padding, peak
memory and MFU (CUDA).

    .venv/bin/python bench/step_compare.py [--model builtin:tiny | --shape qwen2.5-1.5b] [--device cpu|cuda] \\
        [--groups 16 --n 4 --prompt 256 --median 400 --sigma 1 --cap 4096] [--budget 8192] [--micro 4] \\
        [--chunk 1024] [--steps 3] [--compile] [--paths packed,padded,plain] [--batches long-tail,uniform] [--threads 2]

Batches (``--groups`` × ``--n`` trajectories, prompt ``--prompt`` tokens): *long-tail*:
responses log-normal with median ``--median`` and sigma ``--sigma``, capped at ``--cap`` (the
tail agentic RL produces); *uniform*: every response the long-tail batch's mean length, so both
hold the same number of tokens. Every response token is a model token (loss mask 1).

Paths, each on one rank, one after the other (so that each path's peak memory is its own),
each timed over ``--steps`` steps after one warm-up step (medians):

- *packed*: ``TrainStep.run`` as the daemon runs it by default: packed rows, micro-batches of
  at most ``--budget`` tokens (``actor.use_dynamic_bsz``), the chunked log-prob head
  (``actor.log_prob_chunk_tokens = --chunk``), AdamW; ``--compile``: ``actor.use_torch_compile``;
- *padded*: the same step with ``actor.use_remove_padding = false``, micro-batches of ``--micro``
  rows (the path before issue 31);
- *lora*: the packed step with peft adapters of ``--lora-rank`` on every linear layer
  (``actor.target_modules = all-linear``, alpha 2 × rank), the optimiser over the adapters only:
  what LoRA saves in step time and memory on the same batch (MFU still counts every parameter's
  forward and backward: 6 × parameters, an upper bound of LoRA's work);
- *plain*: ~50 lines, independent of the trainer's code: the trajectories first-fit into rows
  of at most ``--budget`` tokens, position ids restarting per sequence and a block-diagonal
  causal mask of its own (flex_attention with a ``BlockMask`` on CUDA, the measured reference
  of issue 31; sdpa with a 4-D boolean mask on the CPU: transformers does not separate packed
  sequences from position ids alone), logits only at response positions, float32 log-softmax,
  a token-mean policy-gradient loss, backward, clip, AdamW.

bf16 autocast over fp32 weights on CUDA, fp32 on the CPU. Tokens/s counts useful tokens
(prompt + response of every trajectory); padding = (processed − useful) / processed, processed
being what the forward passes ran over; peak memory = ``torch.cuda.max_memory_allocated`` per
path (CUDA only); MFU = 6 × parameters × useful tokens / time / the GPU's dense bf16 peak
(bench/gpu.py's table; attention scores ignored: a ~10 % approximation).

``--shape`` builds Qwen2.5-0.5B or -1.5B from its configuration in code with random weights
(speed does not depend on their values), saved once under ``--work``; ``--model`` takes any
model spec. Run the goals of issue 31: on a GPU, packed ≥ 0.9 × plain on the long-tail batch
for the 1.5B shape; on the CPU, packed long-tail tokens/s ≥ 0.9 × packed uniform, padding 0.
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # Qwen2.5 configurations (config.json of the published models), built in code
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def shape_dir(shape: str, work: Path) -> Path:
    """A saved model of ``shape`` with random weights (seed 0), written once."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = work / f"{shape}-random"
    if (out / "COMPLETE").is_file():
        return out
    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    (out / "COMPLETE").write_text("random weights, seed 0\n")
    return out


def make_batches(a, vocab: int):
    """``(long_tail, uniform)`` trajectory lists with the same token count (module docstring)."""
    from asyncrl.wire import Trajectory

    rng = random.Random(0)
    tail = [min(a.cap, max(1, round(math.exp(rng.gauss(math.log(a.median), a.sigma))))) for _ in range(a.groups * a.n)]
    mean = round(sum(tail) / len(tail))

    def build(lengths):
        out = []
        for k, resp in enumerate(lengths):
            g, i = divmod(k, a.n)
            ids = [rng.randrange(3, vocab) for _ in range(a.prompt + resp)]
            out.append(Trajectory(id=f"{g}-{i}", run_id="bench", group_id=f"g{g}", group_size=a.n, group_index=i,
                                  prompt_id="p", data_source="bench", token_ids=ids, prompt_length=a.prompt,
                                  loss_mask=[1] * resp, rollout_logprobs=[-7.0] * resp, weight_versions=[0] * resp,
                                  reward=float(i % 2)))
        return out

    return build(tail), build([mean] * len(tail))


def daemon_path(a, spec: str, ctx, trajs, packed: bool, lora_rank: int = 0):
    """``(step, processed tokens per step)`` of ``TrainStep.run`` on the one-rank policy."""
    from asyncrl.config import load_config
    from trainer_daemon.compute.batch import collate
    from trainer_daemon.compute.packing import pack
    from trainer_daemon.compute.step import StepSettings, TrainStep
    from trainer_daemon.policy.model import (
        attention_for,
        build_optimizer,
        build_policy,
        build_scheduler,
    )

    overrides = [f"rollout.n={a.n}", f"actor.ppo_mini_batch_size={a.groups}", f"model.max_model_len={a.prompt + a.cap}",
                 f"actor.use_remove_padding={str(packed).lower()}", f"actor.log_prob_chunk_tokens={a.chunk}",
                 f"actor.use_dynamic_bsz={str(packed).lower()}", f"actor.ppo_max_token_len_per_gpu={max(a.budget, a.prompt + a.cap)}",
                 f"actor.ppo_micro_batch_size_per_gpu={a.micro}", f"actor.use_torch_compile={str(a.compile).lower()}",
                 f"trainer.mixed_precision={'bf16' if ctx.device.type == 'cuda' else 'fp32'}"]
    if lora_rank:
        overrides += [f"actor.lora_rank={lora_rank}", f"actor.lora_alpha={2 * lora_rank}", "actor.target_modules=all-linear"]
    cfg = load_config(overrides=overrides, environ={})
    attn = attention_for(cfg.actor.attn_implementation, ctx.device, packed)
    lora = (lora_rank, 2.0 * lora_rank, "all-linear") if lora_rank else None
    model = build_policy(spec, 0, ctx.device, 1, cfg.trainer.mixed_precision, compile_blocks=a.compile, attn_implementation=attn,
                         lora=lora)
    opt = build_optimizer(model, cfg.actor.optim)
    step = TrainStep(model, opt, build_scheduler(opt, cfg.actor.optim, None), StepSettings.from_config(cfg, 0), ctx)
    groups = [list(range(i, i + a.n)) for i in range(0, len(trajs), a.n)]
    adv = [0.0] * len(trajs)
    build = pack if packed else collate
    processed = sum(build(trajs, micro, adv, 0).input_ids.numel()
                    for _, plan in step._plans(trajs, groups, [True] * len(trajs)) for micro in plan)
    return (lambda: step.run(trajs, groups)), processed, sum(p.numel() for p in model.parameters())


def plain_path(a, spec: str, device, trajs):
    """The plain packed loop (module docstring); ``(step, processed tokens per step)``."""
    import torch

    from asyncrl.models import load_model

    model = load_model(spec).to(device).train()
    model.config.use_cache = False
    attn = "flex_attention" if device.type == "cuda" else "sdpa"
    model.set_attn_implementation(attn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    rows: list[list[int]] = []
    load: list[int] = []
    for k in sorted(range(len(trajs)), key=lambda k: -len(trajs[k].token_ids)):
        n = len(trajs[k].token_ids)
        r = next((j for j in range(len(rows)) if load[j] + n <= a.budget), None)
        if r is None:
            rows.append([])
            load.append(0)
            r = len(rows) - 1
        rows[r].append(k)
        load[r] += n
    batches, tokens = [], float(sum(t.response_length for t in trajs))
    for row in rows:
        ts = [trajs[k] for k in row]
        ids = torch.tensor([[x for t in ts for x in t.token_ids]], device=device)
        pos = torch.tensor([[p for t in ts for p in range(len(t.token_ids))]], device=device)
        starts = [sum(len(u.token_ids) for u in ts[:j]) for j in range(len(ts))]
        keep = torch.tensor([s + t.prompt_length - 1 + j for s, t in zip(starts, ts, strict=True) for j in range(t.response_length)],
                            device=device)
        labels = ids[0, keep + 1]
        adv = torch.tensor([float(t.reward) - 0.5 for t in ts for _ in range(t.response_length)], device=device)
        doc = torch.tensor([j for j, t in enumerate(ts) for _ in t.token_ids], device=device)
        n = int(doc.numel())
        if attn == "flex_attention":
            from torch.nn.attention.flex_attention import create_block_mask

            mask = create_block_mask(lambda b, h, q, k, doc=doc: (q >= k) & (doc[q] == doc[k]), None, None, n, n,
                                     device=str(device))
        else:
            mask = ((doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool, device=device).tril())[None, None]
        batches.append((ids, pos, keep, labels, adv, mask))
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def one_step() -> None:
        for ids, pos, keep, labels, adv, mask in batches:
            with amp:
                logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, logits_to_keep=keep,
                               use_cache=False).logits[0]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
            (-(adv * logp).sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return one_step, sum(load)


def timed(fns: dict, steps: int, device) -> dict[str, list[float]]:
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
        sync()
    for _ in range(steps):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def sync_points(fn) -> None:
    """One step under ``torch.cuda.set_sync_debug_mode("warn")``: where (file:line, most
    frequent first) it made the host wait for the device."""
    import collections
    import warnings

    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    print(f"    synchronisations in one step: {sum(where.values())}: " + ", ".join(f"{k} x{n}" for k, n in where.most_common(8)),
          flush=True)


def profile_step(fn, device, rows: int) -> None:
    """One profiled step: the wall time against the time the device (or the CPU) was busy, and
    the ``rows`` ops with the most self time on the device (the CPU without one)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    avg = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    busy = sum(getattr(e, key) for e in avg) / 1e6
    print(f"    profiled step: {wall:.3f} s wall (profiler on), {busy:.3f} s {key}", flush=True)
    print("    " + avg.table(sort_by=key, row_limit=rows, max_name_column_width=60).replace("\n", "\n    "), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--shape", choices=sorted(SHAPES), help="Qwen2.5 shape with random weights (instead of --model)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--median", type=int, default=400)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--cap", type=int, default=4096)
    p.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch (packed paths)")
    p.add_argument("--micro", type=int, default=4, help="rows per micro-batch (padded path)")
    p.add_argument("--chunk", type=int, default=1024, help="actor.log_prob_chunk_tokens")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="actor.use_torch_compile on the packed path")
    p.add_argument("--paths", default="packed,padded,plain", help="also: lora (the packed step with --lora-rank adapters)")
    p.add_argument("--lora-rank", type=int, default=16, help="the lora path: adapters of this rank on every linear layer")
    p.add_argument("--batches", default="long-tail,uniform")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile one step of each path and print its N costliest ops")
    p.add_argument("--sync-debug", action="store_true",
                   help="CUDA: after timing, list where one step of each path synchronises with the device")
    p.add_argument("--work", default=str(ROOT / "runs" / "bench-step"))
    a = p.parse_args()
    print("+ " + shlex.join([".venv/bin/python", "bench/step_compare.py", *sys.argv[1:]]), flush=True)

    import torch

    from trainer_daemon.policy.distributed import init_distributed

    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    spec = str(shape_dir(a.shape, Path(a.work))) if a.shape else a.model
    ctx = init_distributed(a.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    peak = None
    if device.type == "cuda":
        from bench.gpu import peak_for

        peak, _ = peak_for(name, a.peak_tflops)
    from asyncrl.models import load_model

    vocab = load_model(spec).config.vocab_size
    print(f"device {name}; model {a.shape or a.model}; torch {torch.__version__}, {a.threads} CPU threads", flush=True)
    try:
        for label, trajs in zip(("long-tail", "uniform"), make_batches(a, vocab), strict=True):
            if label not in a.batches.split(","):
                continue
            useful = sum(len(t.token_ids) for t in trajs)
            resp = [t.response_length for t in trajs]
            print(f"\n{label}: {len(trajs)} trajectories, {useful} tokens (responses {min(resp)}-{max(resp)}, "
                  f"median {statistics.median(resp):.0f}), budget {a.budget}", flush=True)
            for path in a.paths.split(","):
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                fn = None
                try:
                    if path == "plain":
                        fn, processed = plain_path(a, spec, device, trajs)
                        params = sum(p.numel() for p in load_model(spec).parameters())
                    elif path == "lora":
                        fn, processed, params = daemon_path(a, spec, ctx, trajs, packed=True, lora_rank=a.lora_rank)
                    else:
                        fn, processed, params = daemon_path(a, spec, ctx, trajs, packed=path == "packed")
                    secs = statistics.median(timed({path: fn}, a.steps, device)[path])
                except torch.OutOfMemoryError:
                    print(f"  {path:>6}: out of memory (peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)", flush=True)
                    del fn
                    continue
                rate = useful / secs
                extra = ""
                if device.type == "cuda":
                    extra = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
                    if peak:
                        extra += f", MFU {6 * params * rate / (peak * 1e12) * 100:.1f} %"
                print(f"  {path:>6}: {rate:10.1f} tok/s ({secs:.3f} s/step), padding {(processed - useful) / processed * 100:4.1f} %"
                      f"{extra}", flush=True)
                if a.profile:
                    profile_step(fn, device, a.profile)
                if a.sync_debug and device.type == "cuda":
                    try:
                        sync_points(fn)
                    except Exception as exc:  # noqa: BLE001 - a diagnostic: the figures above stand
                        print(f"    sync debug failed: {type(exc).__name__}: {exc}", flush=True)
                del fn
    finally:
        ctx.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
