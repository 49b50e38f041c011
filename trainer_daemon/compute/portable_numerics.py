"""Numerics that every x86-64 CPU computes bit for bit: the environment the warm-ups build in.

A 550-step SFT amplifies the last-bit differences between the kernels that PyTorch, MKL and
glibc pick for the CPU they run on (AVX2 vs AVX-512 vs AMX, Intel vs AMD), so the same recipe
gave different weights on different machines (issue 29). :data:`PORTABLE_ENV` pins every
choice that depends on the CPU; it must be in the environment before torch is imported, so a
build runs in a child process started with it (:func:`portable_environ`):

- ``ATEN_CPU_CAPABILITY=default``: ATen's own kernels use their portable vector type (fixed
  width, no ISA-specific instructions) instead of AVX2/AVX-512 ones;
- ``MKL_CBWR=COMPATIBLE``: MKL's conditional numerical reproducibility on the SSE2 branch
  without approximate instructions, the only branch MKL promises on non-Intel CPUs too
  (fixed blocking, deterministic reductions);
- ``MKL_DYNAMIC=FALSE``, ``MKL_NUM_THREADS=OMP_NUM_THREADS=2``: a fixed thread count whatever the
  machine has (MKL splits long reductions across threads; ATen splits loops by thread count);
- ``DNNL_MAX_CPU_ISA=SSE41``: oneDNN's lowest ISA, should a kernel go through it;
- ``GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4``: glibc's libm takes its SSE2 variants of
  ``expf``/``logf``/... on every CPU rather than FMA ones where the CPU has FMA.

One more source is not an environment variable: ``torch.sqrt`` on CPU goes through MKL's VML,
which ignores CBWR and computes with the CPU's approximate reciprocal square root, whose
tables differ between vendors. The SFT therefore uses the fused AdamW (its square root is an
exact IEEE instruction): see :func:`trainer_daemon.sft.sft`.

Checked by ``bench/portable_numerics.py``: the same build natively on an AMD EPYC with
AVX-512 and under ``qemu-x86_64`` emulating Intel Haswell (AVX2, no AVX-512) and AMD EPYC-Rome
gives identical bytes with this environment and different bytes without it
(docs/benchmarks.md, "The demo's warm-up"). It costs about 2x the speed of the free kernels.

Limits: bit-identity holds for the same torch wheel (the CPU build pinned by
``constraints/cpu.txt``) and the same glibc libm; ARM CPUs and other torch builds compute
other bits (a build there is still deterministic on that machine).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PORTABLE_ENV: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "MKL_DYNAMIC": "FALSE",
    "MKL_NUM_THREADS": "2",
    "OMP_NUM_THREADS": "2",
    "DNNL_MAX_CPU_ISA": "SSE41",
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4",
}


def portable_environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with :data:`PORTABLE_ENV` over it."""
    return {**(os.environ if base is None else base), **PORTABLE_ENV}


def is_portable(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (default: this process's) carries every pin of :data:`PORTABLE_ENV`.

    Only meaningful for a process that imports torch afterwards, or that was started with it."""
    env = os.environ if environ is None else environ
    return all(env.get(name) == value for name, value in PORTABLE_ENV.items())


def check_torch_is_portable() -> None:
    """Raise unless the torch loaded in this process took the pins (it was imported after them)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "DEFAULT" or torch.get_num_threads() != int(PORTABLE_ENV["OMP_NUM_THREADS"]):
        raise RuntimeError(f"torch runs with CPU capability {capability} and {torch.get_num_threads()} threads: "
                           "it was imported before the portable-numerics environment was set")
