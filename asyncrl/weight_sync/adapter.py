"""A LoRA adapter as SGLang's ``/load_lora_adapter_from_tensors`` takes it, and as a directory.

:func:`encode_adapter` gives the payload: base64 of a plain pickle of a dict name → contiguous
CPU tensor (peft's saved names, ``base_model.model.<module>.lora_A.weight``). A plain pickle
crosses hosts (unlike ``ForkingPickler``'s shared-memory handles), and every supported release's
``SafeUnpickler`` (0.5.15-0.5.23) admits it (docs/local_engine.md, "LoRA routes in SGLang";
0.5.15-0.5.16 take one payload for every TP rank, 0.5.17+ one per rank). A directory on shared
storage is the other transport (``sync.adapter_transport = path``: :func:`write_adapter_dir`,
read by ``/load_lora_adapter``). :func:`adapter_checksums` are SGLang's ``expected_checksums``
(0.5.16+): sha256 of each tensor's raw bytes, compared by the engine before it loads.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch


def _cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}


def encode_adapter(tensors: Mapping[str, torch.Tensor]) -> str:
    """The ``serialized_named_tensors`` entry (or 0.5.15/16 ``serialized_tensors``) of one TP rank."""
    return base64.b64encode(pickle.dumps(_cpu(tensors), protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def adapter_checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's bytes, as SGLang's ``tp_worker`` computes them."""
    return {name: hashlib.sha256(t.flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, t in _cpu(tensors).items()}


def write_adapter_dir(path: Path | str, tensors: Mapping[str, torch.Tensor], config: Mapping) -> Path:
    """A peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) at
    ``path``, written to a sibling temporary directory first and renamed into place, so an
    engine never reads half of one. ``path`` must not exist."""
    from safetensors.torch import save_file

    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=False)
    save_file(_cpu(tensors), str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True))
    os.replace(tmp, final)
    return final
