"""Which scaled-dot-product-attention kernels a CUDA process may use.

PyTorch's cuDNN SDPA backend builds (and caches) an execution graph for every new input
shape. An engine decoding with a KV length that grows by one each step, or a trainer whose
micro-batches differ in length, meets a new shape on nearly every call and pays the build
each time. Measured on one H100 (torch 2.11.0+cu130, SmolLM2-135M in bf16, 30 layers, 8 rows
decoding): ``aten::_cudnn_attention_forward`` took 2.1 ms of host time per call against
3 us on the GPU, 63 ms of a 76-111 ms decode step (``docs/benchmarks.md``, GPU section).
The flash and memory-efficient kernels have no per-shape build, so a CUDA process turns the
cuDNN backend off before its first forward.

Limits: the switch is process-wide (``torch.backends``), so it is called once by each
process entry point that puts a model on CUDA (``local_engine``'s engine, the trainer
daemon); a no-op on the CPU. Not covered: other attention implementations (``eager``,
``flash_attention_2``), which do not go through SDPA's backend choice.
"""

from __future__ import annotations

import torch


def avoid_cudnn_attention(device: torch.device) -> bool:
    """Disable the cuDNN SDPA backend when ``device`` is CUDA; True if it did."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True
