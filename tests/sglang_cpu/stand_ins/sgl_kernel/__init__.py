"""A stand-in for SGLang's CUDA kernel library ``sgl_kernel``, for running real SGLang on a CPU.

NOT the real library: no CPU build of ``sgl_kernel`` exists on the package registries, and
SGLang's CPU code imports names from it unguarded at start-up. This module gives SGLang exactly
one real function, ``assign_req_to_token_pool_cpu``, written in plain torch; every other name
(``sgl_kernel.X`` or ``sgl_kernel.sub.module.X``) resolves to a placeholder that is logged when
imported and raises ``NotImplementedError`` naming itself when called, used in arithmetic or
read further. A run that needs any of them fails loudly instead of computing something else.

It is put on the SGLang process's ``PYTHONPATH`` by ``tests/sglang_cpu/server.py`` only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_LOG_IMPORTS = True


def _log(message: str) -> None:
    if _LOG_IMPORTS:
        print(f"[sgl_kernel stand-in] {message}", file=sys.stderr, flush=True)


class MissingKernel:
    """A name the stand-in does not implement: every use raises, naming it."""

    def __init__(self, qualname: str) -> None:
        object.__setattr__(self, "_qualname", qualname)

    def _fail(self, *args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {self._qualname} has no CPU implementation here "
                                  "(tests/sglang_cpu/stand_ins/sgl_kernel); this run needs the real kernel library")

    __call__ = _fail

    def __getattr__(self, name: str):
        # constant tables are read at import (``scalar_types.uint4b8``): a deeper placeholder
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingKernel(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in: missing {self._qualname}>"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """For each request ``r`` (row ``req_pool_indices[r]`` of ``req_to_token``), write its slice of
    ``out_cache_loc`` (the requests' new token slots, concatenated in order) into
    ``req_to_token[row, start_offset[r]:end_offset[r]]``. ``pool_len`` (the row length) is only
    checked."""
    offset = 0
    for r in range(req_pool_indices.shape[0]):
        start, end = int(start_offset[r]), int(end_offset[r])
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: span {start}:{end} outside a row of {pool_len}")
        n = end - start
        req_to_token[int(req_pool_indices[r]), start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def _module_getattr(qualname_prefix: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        _log(f"imported {qualname_prefix}.{name} (a placeholder: raises if used)")
        return MissingKernel(f"{qualname_prefix}.{name}")
    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import sgl_kernel.anything``: an empty module whose every name is a placeholder."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        _log(f"imported module {module.__name__} (placeholders only)")


__getattr__ = _module_getattr(__name__)
__version__ = "0.0.0+asyncrl-cpu-stand-in"
if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _SubmoduleFinder())
