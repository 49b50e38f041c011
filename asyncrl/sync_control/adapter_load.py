"""An adapter sync's engine side (``sync.lora_weights = adapter``): the LoRA adapter of the new
version onto every member of an :class:`~asyncrl.sync_control.engine_update.EngineUpdate`, in
two parts around the same pause → begin → load → end → flush → release sequence as full
weights (:func:`asyncrl.sync_control.sequence.run_update`).

:func:`stage_adapter`, *before* the pause (a new adapter name disturbs no request: requests
keep asking for the current one until the rollout resumes), per member, concurrently, each
call bounded by ``timeout_s``:

1. read its ``/server_info``: LoRA must be on (``enable_lora``); ``transport`` says how the
   adapter reaches it: ``tensors`` through ``/load_lora_adapter_from_tensors`` (every release
   0.5.15-0.5.23 admits a plain pickle of CPU tensors: each release's own unpickler was run on
   the payload; ``serialized_named_tensors``, one copy per TP rank as each rank reads entry
   ``tp_rank``, from 0.5.17; one ``serialized_tensors`` string before), or ``path`` through
   ``/load_lora_adapter`` (``sync.adapter_dir``); ``auto`` takes tensors when the sync has them;
2. unload this run's adapters older than ``keep`` (the version the rollout serves until this
   sync ends: unloading it would leave a failed sync nothing to resume on). Since the last
   sync's pause aborted (or drained) every request, none uses them; SGLang's unload also waits
   for any that does;
3. load the new adapter under its name (a name already loaded — a retried version — is
   unloaded first), with ``expected_checksums`` where the release checks them. A load refused
   because an earlier, partly failed load of that name left "an incomplete unload" (0.5.21+) is
   retried once after unloading the name.

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

from typing import Literal

from asyncrl.engine_client import EngineHTTPError
from asyncrl.lora_targets import serving_problem
from asyncrl.sync_control.engine_update import EngineUpdate, Member
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.sync_control.layout import parse_version
from asyncrl.wire.sync import AdapterSpec, adapter_version

Transport = Literal["auto", "tensors", "path"]
NAMED_FROM = (0, 5, 17)
"""First release with ``serialized_named_tensors`` (before: ``serialized_tensors``)."""
CHECKSUMS_FROM = (0, 5, 16)
INCOMPLETE_UNLOAD = "has an incomplete unload"
"""SGLang 0.5.21+'s refusal of a name whose earlier load failed on some rank (the message says
to retry the unload first)."""


def run_adapters(names, run_id: str) -> dict[str, int]:
    """This run's adapter names among ``names``, with their versions (``<run id>-v<N>``)."""
    return {n: v for n in names if (v := adapter_version(run_id, n)) is not None}


TENSORS_BODY_MAX_BYTES = 256 * 2**20
"""Under ``auto`` with shared storage, an adapter whose bytes × the engine's ``tp_size`` exceed
this goes by ``path``: ``/load_lora_adapter_from_tensors`` carries one copy per TP rank in one
request body (issue 66 N10)."""


def tp_size_of(info: dict) -> int:
    """The engine's TP ranks from its ``/server_info`` (1 when it does not say)."""
    tp = info.get("tp_size")
    return tp if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 else 1


def pick_transport(info: dict, transport: Transport, spec: AdapterSpec, shared_dir: bool = False) -> str:
    """``tensors`` or ``path`` for an engine whose ``/server_info`` is ``info``; raises
    WeightSyncError when neither can work (naming the setting to change). ``shared_dir``: the
    run named ``sync.adapter_dir`` (storage the engines read), so ``auto`` may take ``path`` for
    an adapter too big to repeat per TP rank (:data:`TENSORS_BODY_MAX_BYTES`)."""
    if not info.get("enable_lora"):
        raise WeightSyncError("serves no LoRA adapters: start it with --enable-lora, --max-lora-rank and "
                              "--lora-target-modules, or set sync.lora_weights=merged")
    tp = tp_size_of(info)
    big = shared_dir and spec.path is not None and spec.nbytes * tp > TENSORS_BODY_MAX_BYTES
    choice = transport if transport != "auto" else ("tensors" if spec.tensors and not big else "path")
    if choice == "tensors" and not spec.tensors:
        raise WeightSyncError("this sync carries no adapter tensors (sync.adapter_transport=path on the trainer): "
                              "set sync.adapter_transport=auto or tensors")
    if choice == "path" and spec.path is None:
        raise WeightSyncError(f"sglang {info.get('version')} loads adapters from a path only, and this sync has "
                              "none: set sync.adapter_dir to storage the engines can read")
    return choice


LORA_DP_ATTENTION = ((0, 5, 17), (0, 5, 21))
"""The sglang releases whose LoRA routes accept ``dp_size > 1`` with ``enable_dp_attention``;
the others assert ``dp_size == 1`` (``tokenizer_control_mixin.py``, read from each wheel)."""


def adapter_problems(actor, info: dict, where: str) -> list[str]:
    """Why an engine whose ``/server_info`` is ``info`` cannot serve the adapters of the run's
    ``actor`` section (settings named: :func:`asyncrl.lora_targets.serving_problem`; data-parallel
    replicas where its release asserts one: :data:`LORA_DP_ATTENTION`); empty when it can. An
    engine of an unknown release is not judged on its replicas."""
    on = bool(info.get("enable_lora"))
    if on and (info.get("max_lora_rank") is None or info.get("lora_target_modules") is None):
        return []  # inferred from --lora-paths inside SGLang, not reported: the first sync judges it
    a = actor
    found = serving_problem(a.lora_rank, a.target_modules, info.get("max_lora_rank") if on else None,
                            info.get("lora_target_modules") if on else None, where)
    out = [f"{found}; or set sync.lora_weights=merged"] if found else []
    dp = info.get("dp_size")
    if on and isinstance(dp, int) and dp > 1:
        from asyncrl.sync_control.layout import parse_version

        v = parse_version(str(info.get("version") or ""))
        with_attention = v is not None and LORA_DP_ATTENTION[0] <= v <= LORA_DP_ATTENTION[1]
        if v is not None and not (with_attention and info.get("enable_dp_attention")):
            out.append(f"{where} runs --dp-size {dp}: sglang {info.get('version')} asserts dp_size == 1 when it loads an "
                       f"adapter{' without --enable-dp-attention' if with_attention else ''} (an HTTP 500 at every "
                       "adapter sync); run one engine per data-parallel replica, or set sync.lora_weights=merged")
    most, per_batch = info.get("max_loaded_loras"), info.get("max_loras_per_batch")
    least = max(2, per_batch if isinstance(per_batch, int) else 0)
    if on and isinstance(most, int) and most < least:
        out.append(f"{where} keeps at most {most} adapter(s) (--max-loaded-loras): an adapter sync loads the new "
                   f"version beside the current one, and SGLang also requires --max-loaded-loras >= "
                   f"--max-loras-per-batch ({per_batch}); start it with --max-loaded-loras {least} or more")
    return out


async def stage_adapter(update: EngineUpdate, spec: AdapterSpec, *, run_id: str, keep: int, transport: Transport,
                        timeout_s: float, shared_dir: bool = False) -> set[str]:
    """Steps 1-3 of the module docstring on every member; the ids of the members that staged it
    (a failure is recorded in the member's ``error``)."""

    async def one(m: Member) -> None:
        c = m.client
        info = await c.server_info(timeout_s=timeout_s)
        how = pick_transport(info, transport, spec, shared_dir)
        stale = [n for n, v in run_adapters(await c.lora_adapters(timeout_s=timeout_s), run_id).items()
                 if v < keep or n == spec.name]
        for name in stale:
            await c.unload_lora_adapter(name, timeout_s=timeout_s)
        release = parse_version(str(info.get("version", "")))
        tp = tp_size_of(info)

        async def load() -> None:
            if how == "tensors":
                sums = spec.checksums if release is None or release >= CHECKSUMS_FROM else None
                named = release is None or release >= NAMED_FROM
                await c.load_lora_adapter_from_tensors(spec.name, spec.config, spec.tensors, sums, named=named, tp_size=tp,
                                                       timeout_s=timeout_s)
            else:
                await c.load_lora_adapter(spec.name, spec.path, timeout_s=timeout_s)

        try:
            await load()
        except EngineHTTPError as exc:
            if INCOMPLETE_UNLOAD not in str(exc):
                raise
            await c.unload_lora_adapter(spec.name, timeout_s=timeout_s)  # as SGLang's message asks, then once more
            await load()

    results = await update.each(one, 4 * timeout_s)
    for m in update.members:
        if results[m.id] is not None:
            m.error = f"adapter {spec.name}: {results[m.id]}"
    return {eid for eid, r in results.items() if r is None}


async def switch_adapter(update: EngineUpdate, staged: set[str], name: str, version: int, *, timeout_s: float) -> None:
    """The load step of the sequence (module docstring): ``version`` on every staged member."""

    async def one(m: Member) -> None:
        await m.client.update_weight_version(version, abort_all_requests=False, timeout_s=timeout_s)
        m.sent = m.confirmed = 1  # a failure leaves it unchanged (module docstring)

    results = await update.each(one, timeout_s, [m for m in update.members if m.id in staged])
    for eid, r in results.items():
        if r is not None:
            next(m for m in update.members if m.id == eid).error = f"adapter {name}: setting the version: {r}"
    if not any(m.confirmed for m in update.members):
        why = "; ".join(f"{m.id}: {m.error}" for m in update.members if m.error) or "no engine staged it"
        raise WeightSyncError(f"no engine serves adapter {name} at version {version}: {why}")
