"""Stand-in 2 for real SGLang on a CPU (loaded by every Python process of the SGLang server,
through ``PYTHONPATH``, by ``tests/sglang_cpu/server.py`` only).

SGLang's LoRA code asks for pinned host memory unconditionally (``pin_memory=True``,
``tensor.pin_memory()``), which raises "Found no NVIDIA driver" without a GPU. When CUDA is not
available, and only then, this drops the request: pinned memory only speeds up host→GPU copies,
which a CPU server never makes, so the results are unchanged. For the same reason, SGLang's host
buffers registered with ``cudaHostRegister`` (the routed-experts capturer's, issue 53:
``mem_cache/pool_host/common._cuda_host_register``, ``torch.cuda.cudart()`` without a driver)
are left unregistered when CUDA is not available. Nothing else is altered.
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


def _patch_host_register(module) -> None:
    import torch

    if torch.cuda.is_available() or not hasattr(module, "_cuda_host_register"):
        return
    attr = getattr(module, "_CUDA_HOST_REGISTERED_RANGES_ATTR", None)

    def no_register(buffer, *args, **kwargs):  # nothing registered: nothing for destroy() to unregister
        if attr is not None:
            setattr(buffer, attr, [])

    module._cuda_host_register = no_register


PATCHES = {"torch": _patch_torch, "sglang.srt.mem_cache.pool_host.common": _patch_host_register}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patch each module of :data:`PATCHES` right after its first import (importing them here
    would slow every process): the spec comes from the finders after this one, so there is no
    re-entry and no state."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in PATCHES:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            PATCHES[fullname](module)

        spec.loader.exec_module = exec_module
        return spec


for _name, _patch in PATCHES.items():  # imported before this file ran (a .pth line): patched now
    if _name in sys.modules:
        _patch(sys.modules[_name])
sys.meta_path.insert(0, _AfterImport())
