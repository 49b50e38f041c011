"""What an adapter sync publishes (``sync.lora_weights = adapter``): the LoRA adapter of one
version, as :class:`~asyncrl.wire.sync.AdapterSpec` for the sync agent.

:class:`~trainer_daemon.policy.lora.AdapterSnapshot` (the policy's, taken by the daemon at the sync point (every rank gathers the
trainable parameters only: a few MB, not the model)) is handed to the publisher, which turns
it into a spec with :func:`adapter_spec`: the tensors encoded for
``/load_lora_adapter_from_tensors`` unless ``sync.adapter_transport = path``, and, unless it is
``tensors``, a peft directory ``<adapter_dir>/<name>`` written atomically for engines that load
from a path (SGLang before 0.5.21). The last :data:`KEEP_DIRS` directories are kept; older ones
are removed, never the one an engine may still be reading.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from asyncrl.weight_sync.adapter import adapter_checksums, encode_adapter, write_adapter_dir
from asyncrl.wire.sync import AdapterSpec, adapter_name
from trainer_daemon.policy.lora import AdapterSnapshot

log = logging.getLogger(__name__)

KEEP_DIRS = 3


def adapter_spec(snapshot: AdapterSnapshot, version: int, *, run_id: str, transport: str, adapter_dir: Path) -> AdapterSpec:
    """The spec of the module docstring (writes the directory when the transport may use it)."""
    name = adapter_name(run_id, version)
    path = None
    if transport != "tensors":
        target = Path(adapter_dir) / name
        if target.exists():  # a retried version: the same adapter name gets the new tensors
            shutil.rmtree(target)
        path = str(write_adapter_dir(target, snapshot.tensors, snapshot.config))
        _prune(Path(adapter_dir), run_id)
    tensors = encode_adapter(snapshot.tensors) if transport != "path" else None
    return AdapterSpec(name=name, config=snapshot.config, tensors=tensors, checksums=adapter_checksums(snapshot.tensors),
                       path=path, nbytes=snapshot.nbytes)


def _prune(root: Path, run_id: str) -> None:
    from asyncrl.sync_control.adapter_load import run_adapters

    versions = run_adapters([p.name for p in root.iterdir() if p.is_dir()], run_id)
    for name in sorted(versions, key=versions.get)[:-KEEP_DIRS]:
        shutil.rmtree(root / name, ignore_errors=True)
        log.debug("removed adapter directory %s", root / name)
