"""The load step of an adapter sync (``sync.lora_weights = adapter``): the LoRA adapter of the
new version onto every member of an :class:`~asyncrl.sync_control.engine_update.EngineUpdate`,
inside the same pause → begin → load → end → flush → release sequence as full weights
(:func:`asyncrl.sync_control.sequence.run_update` with this as ``UpdateSteps.load``).

Per member, concurrently, each call bounded by ``timeout_s``:

1. read its ``/server_info``: LoRA must be on (``enable_lora``), and its release says how the
   adapter can reach it (``transport``: ``tensors`` through ``/load_lora_adapter_from_tensors``
   where it takes a plain pickle of CPU tensors — SGLang 0.5.21+, any local_engine release
   with the 0.5.17+ field layout — else ``path`` through ``/load_lora_adapter``; ``auto``
   picks, ``tensors``/``path`` force);
2. unload this run's adapters older than ``keep`` (the version the rollout serves until this
   sync ends: unloading it would leave a failed sync nothing to resume on). The engines are
   paused with ``abort`` (or drained) for an adapter sync, so no request still uses them, and
   SGLang's unload itself waits for any that does;
3. load the new adapter under its name (a name already loaded — a retried version — is
   unloaded first), with ``expected_checksums`` where the release checks them;
4. ``/update_weight_version`` to the new version: the engines' spans label tokens with it.

A LoRA load is whole or nothing on an engine (SGLang validates, then copies into its memory
pool; the previous adapters stay as they were), so no member can be left mixed: a member that
fails keeps serving the previous adapter and version, its ``sent`` stays 0 (outcome
``unchanged``; also when the load went through and only the version call failed: the old
version's adapter is still there) and ``error`` says why. ``update`` must be built with
``total_buckets=1``. The step raises :class:`WeightSyncError` only when no member loaded;
callers hold the failed members out of routing until a later sync loads them
(``sync_agent.coordinator``).
"""

from __future__ import annotations

import re
from typing import Literal

from asyncrl.lora_targets import serving_problem
from asyncrl.sync_control.engine_update import EngineUpdate, Member, _errors
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.sync_control.layout import parse_version
from asyncrl.wire.sync import AdapterSpec

Transport = Literal["auto", "tensors", "path"]
TENSORS_FROM = (0, 5, 21)
"""First SGLang release whose ``SafeUnpickler`` admits a plain pickle of CPU tensors."""
NAMED_FROM = (0, 5, 17)
"""First release with ``serialized_named_tensors`` (before: ``serialized_tensors``)."""
CHECKSUMS_FROM = (0, 5, 16)


def run_adapters(names, run_id: str) -> dict[str, int]:
    """This run's adapter names among ``names``, with their versions (``<run id>-v<N>``)."""
    pattern = re.compile(rf"^{re.escape(run_id)}-v(\d+)$")
    return {n: int(m.group(1)) for n in names if (m := pattern.match(n))}


def pick_transport(info: dict, transport: Transport, spec: AdapterSpec) -> str:
    """``tensors`` or ``path`` for an engine whose ``/server_info`` is ``info``; raises
    WeightSyncError when neither can work (naming the setting to change)."""
    if not info.get("enable_lora"):
        raise WeightSyncError("serves no LoRA adapters: start it with --enable-lora, --max-lora-rank and "
                              "--lora-target-modules, or set sync.lora_weights=merged")
    release = parse_version(str(info.get("version", "")))
    takes_tensors = release is None or release >= TENSORS_FROM or info.get("engine") == "local_engine"
    if release is not None and release < NAMED_FROM:
        takes_tensors = False  # serialized_tensors only: not implemented here
    choice = transport if transport != "auto" else ("tensors" if takes_tensors and spec.tensors else "path")
    if choice == "tensors" and not (takes_tensors and spec.tensors):
        raise WeightSyncError(f"sglang {info.get('version')} cannot take an adapter's tensors over HTTP "
                              f"(from {'.'.join(map(str, TENSORS_FROM))}): set sync.adapter_transport=path")
    if choice == "path" and spec.path is None:
        raise WeightSyncError(f"sglang {info.get('version')} loads adapters from a path only, and this sync has "
                              "none: set sync.adapter_dir to storage the engines can read")
    return choice


def adapter_problems(cfg, info: dict, where: str) -> list[str]:
    """Why an engine whose ``/server_info`` is ``info`` cannot serve the run's adapters
    (settings named: :func:`asyncrl.lora_targets.serving_problem`); empty when it can."""
    on = bool(info.get("enable_lora"))
    if on and (info.get("max_lora_rank") is None or info.get("lora_target_modules") is None):
        return []  # inferred from --lora-paths inside SGLang, not reported: the first sync judges it
    a = cfg.actor
    found = serving_problem(a.lora_rank, a.target_modules, info.get("max_lora_rank") if on else None,
                            info.get("lora_target_modules") if on else None, where)
    out = [f"{found}; or set sync.lora_weights=merged"] if found else []
    most = info.get("max_loaded_loras")
    if on and isinstance(most, int) and most < 2:
        out.append(f"{where} keeps at most {most} adapter (--max-loaded-loras): an adapter sync loads the new "
                   "version beside the current one; start it with --max-loaded-loras 2 or more")
    return out


async def load_adapter(update: EngineUpdate, spec: AdapterSpec, version: int, *, run_id: str, keep: int,
                       transport: Transport, timeout_s: float) -> None:
    """Steps 1-4 of the module docstring on every member of ``update``."""

    async def one(m: Member) -> None:
        c = m.client
        info = await c.server_info(timeout_s=timeout_s)
        how = pick_transport(info, transport, spec)
        stale = [n for n, v in run_adapters(await c.lora_adapters(timeout_s=timeout_s), run_id).items()
                 if v < keep or n == spec.name]
        for name in stale:
            await c.unload_lora_adapter(name, timeout_s=timeout_s)
        release = parse_version(str(info.get("version", "")))
        if how == "tensors":
            sums = spec.checksums if release is None or release >= CHECKSUMS_FROM else None
            await c.load_lora_adapter_from_tensors(spec.name, spec.config, spec.tensors, sums, timeout_s=timeout_s)
        else:
            await c.load_lora_adapter(spec.name, spec.path, timeout_s=timeout_s)
        await c.update_weight_version(str(version), abort_all_requests=False, timeout_s=timeout_s)
        m.sent = m.confirmed = 1  # a failure before here leaves it unchanged (module docstring)

    results = await update.each(one, 4 * timeout_s)
    for m in update.members:
        if results[m.id] is not None:
            m.error = f"adapter {spec.name}: {results[m.id]}"
    if all(r is not None for r in results.values()):
        raise WeightSyncError(f"no engine loaded adapter {spec.name}: {_errors(results)}")
