"""Build a venv that runs real SGLang on this CPU, from the package registries, once per release.

``venv_python(release)`` returns the venv's interpreter, building it first when the cache has
none: ``$ASYNCRL_CACHE_DIR/sglang-cpu/<release>/venv`` (default ``~/.cache/asyncrl``: outside
the clone, so fresh clones and CI reuse it; one venv per release, 4-7 GB each). Steps, each
printed as it starts:

1. ``pip download --no-deps sglang==<release>`` and read the wheel's ``Requires-Dist``;
2. install those requirements (markers evaluated for this machine) minus :data:`CUDA_ONLY`
   (kernel packages that hold only CUDA binaries; nothing here calls them) and minus
   :data:`MEDIA_ONLY`, plus :data:`UNDECLARED` (imported at start-up but not declared), with
   the release's own ``torch==`` pin (the registry's build exactly, never a local ``+cpu`` one:
   torchvision's compiled ops load only against the build they were made for) and the matching
   torchvision;
3. ``pip install --no-deps sglang==<release>``, then ``COMPLETE``.

A concurrent caller waits on a file lock (``asyncrl.models.cache.build_once``). A failed build
raises :class:`SGLangVenvError` naming the step and the package pip could not install, and
leaves no ``COMPLETE`` (the next call starts again). The two stand-ins SGLang needs on a CPU
are not installed into the venv: ``server.py`` puts ``stand_ins/`` on the server's path.

CLI: ``python -m tests.sglang_cpu install [RELEASE ...]`` (``./dev sglang-venv``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from asyncrl.models.cache import MARKER, build_once

DEFAULT_RELEASE = "0.5.23"
# Requirements that are CUDA kernel libraries (no CPU code; sglang-kernel holds sm90/sm100 binaries
# only) or GPU-only helpers: never imported on the CPU path with the stand-ins in place.
CUDA_ONLY = re.compile(r"^(sglang-kernel|sgl-kernel|sgl-deep-ep|sgl-deep-gemm|sgl-flash-mla|flashinfer[-_a-z]*|"
                       r"flash-attn[-_0-9a-z]*|humming-kernels|nvidia-[-_a-z]*|nvshmem4py[-_a-z0-9]*|cuda-python|"
                       r"quack-kernels|tilelang|apache-tvm-ffi|torch[-_]memory[-_]saver|kernels|deepseek-recipe|cuda-tile|"
                       r"tokenspeed[-_]mla)$", re.I)
# Audio/video decoding for multimodal models (pinned to other torch builds): not used by text models.
MEDIA_ONLY = re.compile(r"^(torchaudio|torchcodec|av|decord2?)$", re.I)
# Imported at start-up by some releases without being declared.
UNDECLARED = ("IPython", "dill", "datasets", "timm", "soundfile")
PIP_TIMEOUT_S = 1800


class SGLangVenvError(RuntimeError):
    """The SGLang venv could not be built: the message names the step and the package."""


def cache_root() -> Path:
    return Path(os.environ.get("ASYNCRL_CACHE_DIR") or Path.home() / ".cache" / "asyncrl") / "sglang-cpu"


def venv_dir(release: str) -> Path:
    return cache_root() / release / "venv"


def venv_python(release: str = DEFAULT_RELEASE, progress=print) -> Path:
    """The interpreter of the release's venv, built first if needed (module docstring)."""
    if not re.fullmatch(r"0\.\d+\.\d+(\.post\d+)?", release):
        raise SGLangVenvError(f"not an SGLang release: {release!r} (e.g. 0.5.23)")
    out = build_once(venv_dir(release), lambda d: _build(release, d, progress))
    return out / "bin" / "python"


def _pip(python: Path | str, *args: str, step: str) -> str:
    cmd = [str(python), "-m", "pip", *args, "--disable-pip-version-check", "--no-input"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise SGLangVenvError(f"{step}: pip did not finish in {PIP_TIMEOUT_S} s") from exc
    if out.returncode != 0:
        lines = [ln for ln in out.stderr.splitlines() if not ln.startswith("WARNING: Location")]
        culprit = next((m.group(1) for ln in lines for m in [re.search(
            r"(?:No matching distribution found for|Could not find a version that satisfies the requirement|"
            r"Failed to build|ERROR: Cannot install) ([^\s(]+)", ln)] if m), None)
        if culprit is None:  # a package whose build failed: the last one pip was collecting
            collecting = re.findall(r"^Collecting (\S+)", out.stdout, re.M)
            culprit = collecting[-1] if collecting else None
        tail = "\n".join(lines[-15:])
        raise SGLangVenvError(f"{step} failed{f' at package {culprit}' if culprit else ''} (pip exit {out.returncode}):\n{tail}")
    return out.stdout


def requirements(wheel: Path) -> list[str]:
    """The wheel's runtime requirements that apply here, minus CUDA_ONLY and MEDIA_ONLY, plus
    UNDECLARED; torch pinned exactly as the wheel pins it."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    reqs, names = [], set()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if CUDA_ONLY.match(req.name) or MEDIA_ONLY.match(req.name) or req.name.lower() == "torchvision":
            continue
        if req.name.lower() == "torch":
            pinned = str(req.specifier).removeprefix("==")
            # ``===``: exactly the registry's build of the pin, never a local ``+cpu`` build from
            # pip's find-links: torchvision's compiled ops load only against the build it was made for
            reqs.append(f"torch==={pinned}")
            major, minor = pinned.split(".")[:2]
            reqs.append(f"torchvision==0.{int(minor) + 15}.*" if major == "2" else "torchvision")
        else:
            req.marker = None
            req.extras = set()  # e.g. flashinfer[cu13]: extras pull CUDA libraries
            reqs.append(str(req))
        names.add(req.name.lower())
    reqs += [u for u in UNDECLARED if u.lower() not in names]
    return reqs


def _build(release: str, out: Path, progress) -> None:
    start = time.monotonic()
    shutil.rmtree(out, ignore_errors=True)  # a partial venv of a failed build; we hold the lock
    progress(f"sglang-cpu {release}: building its venv in {out} (one time per release; ~3-5 min, 4-7 GB)")
    with tempfile.TemporaryDirectory(prefix=f"sglang-{release}-") as tmp:
        progress(f"sglang-cpu {release}: [1/4] downloading the sglang wheel")
        _pip(sys.executable, "download", "--no-deps", "--only-binary=:all:", "-d", tmp, f"sglang=={release}",
             step=f"downloading sglang=={release}")
        wheel = next(Path(tmp).glob("sglang-*.whl"))
        reqs = requirements(wheel)
        (Path(tmp) / "requirements.txt").write_text("\n".join(reqs) + "\n")
        progress(f"sglang-cpu {release}: [2/4] creating the venv")
        subprocess.run([sys.executable, "-m", "venv", str(out)], check=True, timeout=300)
        python = out / "bin" / "python"
        progress(f"sglang-cpu {release}: [3/4] installing {len(reqs)} requirements "
                 f"({next(r for r in reqs if r.startswith('torch=='))}; CUDA-only kernels left out)")
        _pip(python, "install", "--progress-bar", "off", "-r", str(Path(tmp) / "requirements.txt"),
             step=f"installing sglang {release}'s requirements")
        progress(f"sglang-cpu {release}: [4/4] installing sglang {release} itself")
        _pip(python, "install", "--quiet", "--no-deps", str(wheel), step=f"installing sglang=={release}")
        (out / "requirements.txt").write_text("\n".join(reqs) + "\n")
    subprocess.run([str(python), "-c", "import sglang, torch, transformers"], check=True, timeout=300,
                   capture_output=True)
    (out / MARKER).write_text(f"sglang {release}\n")
    progress(f"sglang-cpu {release}: ready in {time.monotonic() - start:.0f} s")
