"""Stand-in 2 for real SGLang on a CPU (loaded by every Python process of the SGLang server,
through ``PYTHONPATH``, by ``tests/sglang_cpu/server.py`` only).

SGLang's LoRA code asks for pinned host memory unconditionally (``pin_memory=True``,
``tensor.pin_memory()``), which raises "Found no NVIDIA driver" without a GPU. When CUDA is not
available, and only then, this drops the request: pinned memory only speeds up host→GPU copies,
which a CPU server never makes, so the results are unchanged. Nothing else is altered.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys


def _patch_torch(torch) -> None:
    if torch.cuda.is_available():
        return

    def drop_pin(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)
        return wrapper

    for name in ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "empty_like", "zeros_like",
                 "ones_like", "full_like", "empty_strided", "randn", "rand"):
        if hasattr(torch, name):
            setattr(torch, name, drop_pin(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.Tensor.is_pinned = lambda self, *a, **k: False


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Patch torch right after its first import (importing it here would slow every process)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec("torch")
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _patch_torch(module)

        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterTorch())
