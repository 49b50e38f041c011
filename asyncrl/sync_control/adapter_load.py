"""An adapter sync's engine side (``sync.lora_weights = adapter``): the LoRA adapter of the new
version onto every member of an :class:`~asyncrl.sync_control.engine_update.EngineUpdate`, in
two parts around the same pause → begin → load → end → flush → release sequence as full
weights (:func:`asyncrl.sync_control.sequence.run_update`).

:func:`stage_adapter`, *before* the pause (a new adapter name disturbs no request: requests
keep asking for the current one until the rollout resumes), per member, concurrently, each
call bounded by ``timeout_s``:

1. read its ``/server_info``: LoRA must be on (``enable_lora``), and its release says how the
   adapter can reach it (``transport``: ``tensors`` through ``/load_lora_adapter_from_tensors``
   where it takes a plain pickle of CPU tensors — SGLang 0.5.21+, local_engine — else ``path``
   through ``/load_lora_adapter``; ``auto`` picks, ``tensors``/``path`` force);
2. unload this run's adapters older than ``keep`` (the version the rollout serves until this
   sync ends: unloading it would leave a failed sync nothing to resume on). Since the last
   sync's pause aborted (or drained) every request, none uses them; SGLang's unload also waits
   for any that does;
3. load the new adapter under its name (a name already loaded — a retried version — is
   unloaded first), with ``expected_checksums`` where the release checks them.

:func:`switch_adapter` is the sequence's load step, inside the pause: ``/update_weight_version``
on every member that staged the adapter (the engines' spans and ``/model_info`` say the new
version). The rollout then resumes asking for the new adapter by name. So the pause window
holds a few control calls whatever the adapter's size.

A LoRA load is whole or nothing on an engine (SGLang validates, then copies into its memory
pool; the previous adapters stay as they were), so no member can be left mixed: a member that
fails either part keeps serving the previous adapter and version, its ``sent`` stays 0
(outcome ``unchanged``) and ``error`` says why. :func:`switch_adapter` raises
:class:`WeightSyncError` only when no member has the new version; callers hold the failed
members out of routing until a later sync loads them (``sync_agent.coordinator``).
``update`` must be built with ``total_buckets=1``.
"""

from __future__ import annotations

import re
from typing import Literal

from asyncrl.lora_targets import serving_problem
from asyncrl.sync_control.engine_update import EngineUpdate, Member
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


def adapter_problems(actor, info: dict, where: str) -> list[str]:
    """Why an engine whose ``/server_info`` is ``info`` cannot serve the adapters of the run's
    ``actor`` section (settings named: :func:`asyncrl.lora_targets.serving_problem`); empty when it can."""
    on = bool(info.get("enable_lora"))
    if on and (info.get("max_lora_rank") is None or info.get("lora_target_modules") is None):
        return []  # inferred from --lora-paths inside SGLang, not reported: the first sync judges it
    a = actor
    found = serving_problem(a.lora_rank, a.target_modules, info.get("max_lora_rank") if on else None,
                            info.get("lora_target_modules") if on else None, where)
    out = [f"{found}; or set sync.lora_weights=merged"] if found else []
    most, per_batch = info.get("max_loaded_loras"), info.get("max_loras_per_batch")
    least = max(2, per_batch if isinstance(per_batch, int) else 0)
    if on and isinstance(most, int) and most < least:
        out.append(f"{where} keeps at most {most} adapter(s) (--max-loaded-loras): an adapter sync loads the new "
                   f"version beside the current one, and SGLang also requires --max-loaded-loras >= "
                   f"--max-loras-per-batch ({per_batch}); start it with --max-loaded-loras {least} or more")
    return out


async def stage_adapter(update: EngineUpdate, spec: AdapterSpec, *, run_id: str, keep: int, transport: Transport,
                        timeout_s: float) -> set[str]:
    """Steps 1-3 of the module docstring on every member; the ids of the members that staged it
    (a failure is recorded in the member's ``error``)."""

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

    results = await update.each(one, 4 * timeout_s)
    for m in update.members:
        if results[m.id] is not None:
            m.error = f"adapter {spec.name}: {results[m.id]}"
    return {eid for eid, r in results.items() if r is None}


async def switch_adapter(update: EngineUpdate, staged: set[str], name: str, version: int, *, timeout_s: float) -> None:
    """The load step of the sequence (module docstring): ``version`` on every staged member."""

    async def one(m: Member) -> None:
        await m.client.update_weight_version(str(version), abort_all_requests=False, timeout_s=timeout_s)
        m.sent = m.confirmed = 1  # a failure leaves it unchanged (module docstring)

    results = await update.each(one, timeout_s, [m for m in update.members if m.id in staged])
    for eid, r in results.items():
        if r is not None:
            next(m for m in update.members if m.id == eid).error = f"adapter {name}: setting the version: {r}"
    if not any(m.confirmed for m in update.members):
        why = "; ".join(f"{m.id}: {m.error}" for m in update.members if m.error) or "no engine staged it"
        raise WeightSyncError(f"no engine serves adapter {name} at version {version}: {why}")
