"""Which SGLang release local_engine behaves like (``--sglang-compat``), and what differs.

Read from the sglang wheels' source (0.5.18 through 0.5.23); each switch names the first
release that behaves the new way:

- ``sessions`` (0.5.21): ``/begin_weight_update`` and ``/end_weight_update`` exist, and
  ``/update_weights_from_distributed`` outside a session answers 400 "must run between
  begin_weight_update() and end_weight_update()" without joining the broadcast. Older
  releases have no such routes (404).
- ``flush_ignores_queue_when_paused`` (0.5.21): a cache flush (``/flush_cache``, or an update
  with ``flush_cache: true``) needs no running request, and while the engine is paused it
  ignores queued ones — the requests a ``retract`` pause put back. Older releases also need an
  empty queue, so a flush after a retract fails there.
- ``dp_strict`` (0.5.22): weight-update routes assert ``dp_size == 1``; older releases also
  accept ``dp_size > 1`` with ``enable_dp_attention``. A failed assert is an HTTP 500.
- ``lora_dp_attention`` (0.5.17 to 0.5.21): the LoRA routes (``/load_lora_adapter``,
  ``/load_lora_adapter_from_tensors``, ``/unload_lora_adapter``) accept ``dp_size > 1`` with
  ``enable_dp_attention``; 0.5.15-0.5.16 and 0.5.22+ assert ``dp_size == 1`` (an HTTP 500, after
  the "LoRA is not enabled" check).
- ``soft_flush_failure`` (0.5.22): an update with ``flush_cache: true`` while requests are
  running or queued answers failure ("Weights were updated, but the cache was not
  flushed ..."); older releases ``assert`` in the scheduler, which kills the engine.
- ``sampling_mask`` (0.5.16): ``/generate`` takes ``return_sampling_mask`` and answers each
  output token's sampling support and behaviour log-prob (:mod:`local_engine.sampler`).
- ``sampling_mask_cap`` (0.5.20): ``--sampling-mask-max-tokens`` (default 4096) bounds a
  support; a request whose support is larger ends with an abort (400). 0.5.19 has no bound.
- ``sampling_logprobs_mode`` (0.5.21): ``sampling_logprobs_mode`` (``selected`` | ``support``).
- ``align_before_broadcast`` (0.5.23): a flattened bucket whose tensors are not aligned to
  their element size is refused before the broadcast; older releases fail after it.
- ``contract_gate`` (0.5.22): ``sampling_params`` are decoded by a msgspec contract gate before
  anything else: an unknown key or a wrong type answers ``400 {"error": "<message>"}``.
- ``model_info_serving`` (0.5.21): ``/model_info`` also names ``served_model_name``,
  ``load_format``, ``reasoning_parser``, ``tool_call_parser`` and ``disaggregation_mode``.
- ``legacy_routes`` (up to 0.5.20): ``/get_load`` (a list of per-DP-rank loads) and
  ``/get_weight_version`` (404 in the validation shape: "deprecated, use /model_info"); 0.5.21
  removed both (FastAPI's 404). ``/server_info``'s ``sampling_mask_max_tokens`` from 0.5.20.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.sync_control.layout import parse_version

SUPPORTED = ((0, 5, 15), (0, 5, 23))
"""Oldest and newest release local_engine can emulate."""
DEFAULT = "0.5.23"


@dataclass(frozen=True)
class SglangCompat:
    version: str
    sessions: bool
    dp_strict: bool
    soft_flush_failure: bool
    align_before_broadcast: bool
    flush_ignores_queue_when_paused: bool
    abort_once: bool
    """0.5.20+: the tokenizer passes one exact-rid abort per request to the scheduler and drops
    every later one (``ReqState.abort_sent``), also when the first found the request not yet
    scheduled (held at the pause gate)."""
    weight_version_spans: bool
    """0.5.19+: every finished output carries ``meta_info.weight_versions`` (at least one span);
    unfinished ones (stream chunks) none; before 0.5.19 none at all."""
    sampling_mask: bool
    """0.5.16+: ``return_sampling_mask`` (module docstring)."""
    sampling_mask_cap: bool
    """0.5.20+: ``--sampling-mask-max-tokens`` bounds a returned support."""
    sampling_logprobs_mode: bool
    """0.5.21+: ``sampling_logprobs_mode``."""
    contract_gate: bool = True
    """0.5.22+: ``sampling_params`` decode errors answer ``{"error": "<message>"}``."""
    model_info_serving: bool = True
    """0.5.21+: ``/model_info``'s serving fields (module docstring)."""
    legacy_routes: bool = False
    """Up to 0.5.20: ``/get_load`` and ``/get_weight_version`` exist (module docstring)."""
    lora_dp_attention: bool = False
    """0.5.17-0.5.21: the LoRA routes accept ``dp_size > 1`` with ``enable_dp_attention`` (module docstring)."""

    @classmethod
    def of(cls, version: str) -> SglangCompat:
        v = parse_version(version)
        if v is None or not SUPPORTED[0] <= v <= SUPPORTED[1]:
            lo, hi = (".".join(map(str, x)) for x in SUPPORTED)
            raise ValueError(f"--sglang-compat {version!r}: local_engine emulates sglang {lo} to {hi}")
        return cls(version=".".join(map(str, v)), sessions=v >= (0, 5, 21), dp_strict=v >= (0, 5, 22),
                   soft_flush_failure=v >= (0, 5, 22), align_before_broadcast=v >= (0, 5, 23),
                   flush_ignores_queue_when_paused=v >= (0, 5, 21), abort_once=v >= (0, 5, 20),
                   weight_version_spans=v >= (0, 5, 19), sampling_mask=v >= (0, 5, 16),
                   sampling_mask_cap=v >= (0, 5, 20), sampling_logprobs_mode=v >= (0, 5, 21),
                   contract_gate=v >= (0, 5, 22), model_info_serving=v >= (0, 5, 21), legacy_routes=v <= (0, 5, 20),
                   lora_dp_attention=(0, 5, 17) <= v <= (0, 5, 21))
