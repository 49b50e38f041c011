"""Weight sync from trainer rank 0 to the inference engines (``WeightPublisher`` and its two
implementations), chosen by config: ``sync.url`` set → the sync agent's protocol, else
``engines.urls`` set → the trainer drives the engines itself, else no sync (logged)."""

from __future__ import annotations

import logging

from trainer_daemon.sync.base import SyncController, WeightPublisher

log = logging.getLogger(__name__)

__all__ = ["SyncController", "WeightPublisher", "build_publisher", "weight_sync_backend"]


def weight_sync_backend(cfg) -> str:
    """``trainer.weight_sync_backend``, or gloo on cpu / nccl on cuda."""
    return cfg.trainer.weight_sync_backend or ("nccl" if cfg.trainer.device == "cuda" else "gloo")


def build_publisher(cfg) -> WeightPublisher | None:
    """The publisher the config asks for (module docstring); None when there is nothing to sync to."""
    t, s = cfg.trainer, cfg.sync
    backend = weight_sync_backend(cfg)
    if s.url:
        from trainer_daemon.sync.agent import SyncAgentPublisher

        token = cfg.security.sync_token.get_secret_value() if cfg.security.sync_token else None
        return SyncAgentPublisher(
            s.url, token, master_address=t.master_addr, master_port=t.weight_sync_port, backend=backend,
            bucket_bytes=s.bucket_bytes,
            group_timeout_s=s.group_init_timeout_s, pause_timeout_s=s.pause_timeout_s,
            broadcast_timeout_s=s.broadcast_timeout_s,
        )
    if cfg.engines.urls:
        from asyncrl.engine_client import EngineClient
        from trainer_daemon.sync.direct import DirectEnginePublisher

        e = cfg.engines
        key = e.api_key.get_secret_value() if e.api_key else None
        admin = e.admin_api_key.get_secret_value() if e.admin_api_key else None
        engines = [EngineClient(u, api_key=key, admin_api_key=admin, control_timeout_s=e.control_timeout_s) for u in e.urls]
        return DirectEnginePublisher(
            engines, master_address=t.master_addr, master_port=t.weight_sync_port, backend=backend,
            bucket_bytes=s.bucket_bytes,
            group_timeout_s=s.group_init_timeout_s, broadcast_timeout_s=s.broadcast_timeout_s,
            control_timeout_s=max(cfg.engines.control_timeout_s, s.pause_timeout_s),
        )
    log.warning("no sync.url and no engines.urls: weights are not broadcast (checkpoints and HF exports still are)")
    return None
