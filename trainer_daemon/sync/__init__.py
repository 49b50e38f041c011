"""Weight sync from trainer rank 0 to the inference engines (``WeightPublisher`` and its two
implementations), chosen by config: ``sync.url`` set → the sync agent's protocol, else
``engines.urls`` set → the trainer drives the engines itself, else no sync (logged). Adapter
syncs (``sync.lora_weights = adapter``) go through the sync agent only."""

from __future__ import annotations

import logging
from pathlib import Path

from asyncrl.config import secret
from trainer_daemon.sync.base import SyncController, WeightPublisher

log = logging.getLogger(__name__)

__all__ = ["SyncController", "WeightPublisher", "build_publisher", "staging_device", "staging_mode", "weight_sync_backend"]


def weight_sync_backend(trainer, engines) -> str:
    """``trainer.weight_sync_backend`` when set; otherwise nccl only for SGLang engines
    (``engines.backend == "sglang"``) with a CUDA trainer, gloo in every other case: a
    local_engine joins weight-update groups with gloo only, whatever its device."""
    if trainer.weight_sync_backend is not None:
        return trainer.weight_sync_backend
    return "nccl" if engines.backend == "sglang" and trainer.device == "cuda" else "gloo"


AUTO_FULL_COPY_FRACTION = 0.1
"""``sync.staging = auto`` with NCCL keeps a full packed copy (``buckets``) only while the
model's bytes in ``model.dtype`` are at most this share of the GPU's memory (a 1.5B model in
bf16: 3.9 % of 80 GB; a 7B: 19 %), else streams it through two buckets (``two_buckets``)."""


def staging_mode(sync, actor, backend: str, model_bytes: int | None = None, device_bytes: int | None = None) -> str:
    """``sync.staging`` resolved (``sync`` and ``actor`` sections, the weight group's
    ``backend``: :func:`weight_sync_backend`). ``auto``: ``state_dict`` (through host memory) unless the
    weight group is NCCL; with NCCL ``buckets`` (packed on the GPU at the sync point) when
    ``model_bytes`` (the engines' weights in ``model.dtype``) fit in
    ``AUTO_FULL_COPY_FRACTION`` of ``device_bytes`` (or either is unknown), else
    ``two_buckets`` (:mod:`trainer_daemon.sync.streaming`). LoRA merged into the weights
    (``actor.lora_rank``, ``sync.lora_weights = merged``): ``state_dict``, where the adapters
    are merged (the config refuses the others with it). Adapter syncs stage nothing of this:
    :class:`~trainer_daemon.policy.lora.AdapterSnapshot`."""
    if sync.staging != "auto":
        return sync.staging
    if actor.lora_rank:
        return "state_dict"
    if backend != "nccl":
        return "state_dict"
    if model_bytes is not None and device_bytes and model_bytes > AUTO_FULL_COPY_FRACTION * device_bytes:
        return "two_buckets"
    return "buckets"


def staging_device(backend: str) -> str:
    """Where staged buckets live: where the weight group's ``backend`` reads them."""
    return "cuda" if backend == "nccl" else "cpu"


def build_publisher(cfg) -> WeightPublisher | None:
    """The publisher the config asks for (module docstring); None when there is nothing to sync to."""
    t, s = cfg.trainer, cfg.sync
    backend = weight_sync_backend(cfg.trainer, cfg.engines)
    if s.url:
        from trainer_daemon.sync.agent import SyncAgentPublisher

        token = secret(cfg.security.sync_token)
        adapters = None
        if cfg.syncs_adapters:
            adapters = {"run_id": cfg.run.id, "transport": s.adapter_transport,
                        "adapter_dir": Path(s.adapter_dir) if s.adapter_dir else cfg.run_dir / "adapters"}
        return SyncAgentPublisher(
            s.url, token, master_address=t.master_addr, master_port=t.weight_sync_port, backend=backend,
            bucket_bytes=s.bucket_bytes,
            group_timeout_s=s.group_init_timeout_s, pause_timeout_s=s.pause_timeout_s,
            broadcast_timeout_s=s.broadcast_timeout_s, adapters=adapters,
        )
    if cfg.syncs_adapters and cfg.engines.urls:
        raise ValueError("sync.lora_weights=adapter needs the sync agent (sync.url): the rollout service learns which "
                         "adapter to ask for when the agent resumes it. Set sync.url, or sync.lora_weights=merged")
    if cfg.engines.urls and s.pause_policy == "per_request" and cfg.async_training.partial_rollout_active:
        raise ValueError("sync.pause_policy=per_request needs the sync agent (sync.url): the rollout service decides "
                         "per call when the agent pauses it. Set sync.url, or another sync.pause_policy")
    if cfg.engines.urls:
        from asyncrl.engine_client import EngineClient
        from trainer_daemon.sync.direct import DirectEnginePublisher

        e = cfg.engines
        engines = [EngineClient(u, api_key=secret(e.api_key), admin_api_key=secret(e.admin_api_key),
                                control_timeout_s=e.control_timeout_s) for u in e.urls]
        from asyncrl.sync_control.pause_policy import plan_for

        plan = plan_for(cfg.sync, cfg.async_training)
        return DirectEnginePublisher(
            engines, master_address=t.master_addr, master_port=t.weight_sync_port, backend=backend,
            bucket_bytes=s.bucket_bytes,
            group_timeout_s=s.group_init_timeout_s, broadcast_timeout_s=s.broadcast_timeout_s,
            control_timeout_s=max(cfg.engines.control_timeout_s, s.pause_timeout_s),
            pause_mode=plan.engine_mode, flush_retries=plan.flush_retries, check_weights=s.check_weights,
        )
    log.warning("no sync.url and no engines.urls: weights are not broadcast (checkpoints and HF exports still are)")
    return None
