"""The device plumbing of local_engine, checked on a CPU-only machine (and for real on CUDA).

What runs everywhere:

- ``--device cuda`` without a usable GPU stops at start with exit code 2 and a message naming
  the device, not a traceback (and ``bench/gpu.py`` exits 2 saying CUDA is not available);
- :class:`HFModelRunner` and the sampler *name* the device of every tensor they create (a
  ``TorchFunctionMode`` records each factory call made from ``local_engine/runner.py`` and
  ``local_engine/sampler.py``): the runner the model's device, the sampler the logits'
  device, except the uniforms drawn from CPU generators. On a CPU-only machine this is the
  honest part of "device-agnostic": it catches a factory that silently takes the default
  device (CPU), which works here and breaks on CUDA. It does not prove CUDA kernels work;
- the runner's state (mask, lengths, KV cache) and its logits live on the model's device.

What runs only where ``torch.cuda.is_available()``: the same checks with device ``cuda``, and
CUDA logits and greedy tokens against CPU ones for the same fp32 weights.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from local_engine.runner import HFModelRunner, resolve_device
from local_engine.sampler import RowSampling, prompt_logprobs, sample

CLI_TIMEOUT_S = 120  # importing torch + transformers on a busy 2-core box
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", *(["cuda"] if HAS_CUDA else [])]
FACTORIES = {torch.tensor, torch.as_tensor, torch.full, torch.zeros, torch.ones, torch.empty, torch.arange,
             torch.rand, torch.randn, torch.randint}
WATCHED = {"runner.py", "sampler.py"}
LOCAL_ENGINE = Path(__file__).resolve().parents[2] / "local_engine"


class FactoryRecorder(TorchFunctionMode):
    """Records ``(file, line, factory, device kwarg, generator?)`` for factory calls made
    directly from the watched local_engine modules (transformers' own calls are not ours)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, str, object, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            path = Path(frame.f_code.co_filename) if frame is not None else None
            if path is not None and path.parent == LOCAL_ENGINE and path.name in WATCHED:
                self.calls.append((path.name, frame.f_lineno, func.__name__, kwargs.get("device"), "generator" in kwargs))
        return func(*args, **kwargs)


def _same(device, expected: torch.device) -> bool:
    return device is not None and torch.device(device).type == expected.type


@pytest.fixture(scope="module")
def tiny_cpu():
    from asyncrl.models import load_model, load_tokenizer

    tok = load_tokenizer("builtin:tiny")
    return load_model("builtin:tiny", dtype="float32", seed=0), tok.pad_token_id or 0


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA: nothing to refuse")
def test_cuda_without_gpu_exits_2_naming_the_device():
    out = subprocess.run([sys.executable, "-m", "local_engine", "--device", "cuda", "--port", "1"],
                         capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "asyncrl engine:" in out.stderr and "device 'cuda'" in out.stderr and "--device cpu" in out.stderr
    with pytest.raises(ValueError, match="device 'cuda'"):
        resolve_device("cuda")


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA: nothing to refuse")
def test_gpu_bench_exits_2_without_cuda():
    """bench/gpu.py checks for CUDA before anything else (no engine, no model directory)."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
    out = subprocess.run([sys.executable, str(bench), "--out", "/nonexistent/never-written"], capture_output=True, text=True,
                         timeout=CLI_TIMEOUT_S)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "CUDA is not available" in out.stderr, out.stderr[-2000:]


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    if HAS_CUDA:
        assert resolve_device("cuda").type == "cuda"


@pytest.mark.parametrize("device", DEVICES)
def test_runner_creates_every_tensor_on_the_model_device(tiny_cpu, device):
    import copy

    model, pad = tiny_cpu
    model = copy.deepcopy(model).to(device)
    runner = HFModelRunner(model, pad_token_id=pad)
    want = torch.device(device)
    assert runner.device.type == want.type
    rec = FactoryRecorder()
    with rec:
        pf = runner.prefill([[5, 6, 7, 8], [9, 10]], [False, True])
        logits = [pf.last, pf.prompt[1], runner.decode([11, 12])]
        logits.append(runner.prefill([[13, 14, 15, 16, 17, 18]], [False]).last)  # merge with a wider row
        logits.append(runner.decode([19, 20, 21]))
        runner.keep([1, 2])  # drop row 0: index select and trim
        logits.append(runner.decode([22, 23]))
    ours = [c for c in rec.calls if c[0] == "runner.py"]
    assert ours, "the recorder saw no factory call from runner.py: the check would be vacuous"
    assert not [c for c in ours if not _same(c[3], want)], f"factories not on {want}: {ours}"
    assert all(t.device.type == want.type and t.dtype == torch.float32 for t in logits)
    assert runner._mask.device.type == runner._lengths.device.type == want.type
    for layer in runner._cache.layers:
        assert layer.keys.device.type == layer.values.device.type == want.type
    assert runner.num_rows == 2 and torch.isfinite(logits[-1]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_works_on_the_logits_device(device):
    want = torch.device(device)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).to(device)
    rows = [RowSampling(temperature=0.0, sampling_mask=True), RowSampling(temperature=0.0, banned=[int(logits[1].argmax())]),
            RowSampling(temperature=0.8, top_k=5, sampling_mask=True), RowSampling(top_p=0.5, min_p=0.1, sampling_mask=True),
            RowSampling(generator=torch.Generator().manual_seed(7)), RowSampling(temperature=1.3)]
    rec = FactoryRecorder()
    with rec:
        out = sample(logits, rows, torch.Generator().manual_seed(1), top_logprobs=[0, 3, 0, 0, 2, 0])
        lps = prompt_logprobs(logits, [1, 2, 3, 4, 5, 6], temperature=0.7)
    assert rec.calls, "the recorder saw no factory call from sampler.py: the check would be vacuous"
    unnamed = [c for c in rec.calls if c[3] is None]
    assert not unnamed, f"factories that take the default device: {unnamed}"
    elsewhere = [c for c in rec.calls if not _same(c[3], want)]
    assert all(c[2] == "rand" and c[4] and torch.device(c[3]).type == "cpu" for c in elsewhere), elsewhere
    assert all(type(t) is int for t in out.token_ids) and all(type(v) is float for v in out.logprobs)
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[1] != int(logits[1].argmax())
    assert out.top[1] is not None and all(type(v) is float and type(i) is int for v, i in out.top[1])
    assert lps[0] is None and all(type(v) is float for v in lps[1:])
    masks = out.masks  # sampling masks come back as Python numbers too
    assert [m is not None for m in masks] == [True, False, True, True, False, False]
    assert all(type(i) is int for m in masks if m for i in m.support) and type(masks[2].selected_logprob) is float
    assert out.token_ids[2] in masks[2].support and len(masks[2].support) == 5


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefill_over_an_exported_prefix_continues_the_row(tiny_cpu, device):
    """A retracted request's re-prefill over its kept prompt KV (``export_prefix``, then
    ``prefill(prefixes=...)``) gives the same next-token logits as one prefill of the whole
    context with the same weights, on the model's device, beside a row without a prefix."""
    import copy

    model, pad = tiny_cpu
    runner = HFModelRunner(copy.deepcopy(model).to(device), pad_token_id=pad)
    prompt, output = [5, 6, 7, 8, 9], [21, 22, 23]
    runner.prefill([[3, 4], prompt], [False, False])
    prefix = runner.export_prefix(1, len(prompt))
    assert prefix is not None and prefix[0][0].device.type == torch.device(device).type and prefix[0][0].shape[-2] == len(prompt)
    runner.reset()
    pf = runner.prefill([[11, 12, 13], prompt + output], [False, False], prefixes=[None, prefix])
    whole = HFModelRunner(copy.deepcopy(model).to(device), pad_token_id=pad).prefill([prompt + output], [False]).last
    assert (pf.last[1] - whole[0]).abs().max().item() < 1e-4
    assert runner.num_rows == 2 and runner._mask.device.type == torch.device(device).type
    nxt = runner.decode([int(pf.last[0].argmax()), int(pf.last[1].argmax())])  # the merged rows decode on
    assert torch.isfinite(nxt).all()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_sampling_masks_match_cpu():
    """The same logits and seeded rows on both devices: the same tokens, supports and
    behaviour log-probs (to float tolerance)."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)) * 3
    outs = {}
    for device in ("cpu", "cuda"):
        rows = [RowSampling(temperature=0.7, top_k=8, generator=torch.Generator().manual_seed(3), sampling_mask=True),
                RowSampling(top_p=0.8, generator=torch.Generator().manual_seed(4), sampling_mask=True),
                RowSampling(temperature=0.0, sampling_mask=True)]
        outs[device] = sample(logits.to(device), rows, torch.Generator().manual_seed(1))
    cpu, cuda = outs["cpu"], outs["cuda"]
    assert cpu.token_ids == cuda.token_ids
    for a, b in zip(cpu.masks, cuda.masks, strict=True):
        assert a.support == b.support and abs(a.selected_logprob - b.selected_logprob) < 1e-5


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_runner_matches_cpu(tiny_cpu):
    """fp32 weights on both devices: logits agree to float tolerance, greedy tokens match."""
    import copy

    model, pad = tiny_cpu
    runs = {}
    for device in ("cpu", "cuda"):
        runner = HFModelRunner(copy.deepcopy(model).to(device), pad_token_id=pad)
        g = torch.Generator().manual_seed(0)
        greedy = [RowSampling(temperature=0.0)] * 2
        pf = runner.prefill([[5, 6, 7, 8], [9, 10]], [False, False])
        steps = [pf.last.cpu()]
        tokens = sample(pf.last, greedy, g).token_ids
        seen = [tokens]
        for _ in range(8):
            logits = runner.decode(tokens)
            steps.append(logits.cpu())
            tokens = sample(logits, greedy, g).token_ids
            seen.append(tokens)
        runs[device] = (steps, seen)
    for a, b in zip(runs["cpu"][0], runs["cuda"][0], strict=True):
        assert (a - b).abs().max().item() < 1e-3
    assert runs["cpu"][1] == runs["cuda"][1]
