"""Engines of the rollout service: routing with prefix affinity (:mod:`.pool`), each engine's
state (:mod:`.handle`), health checks (:mod:`.health`), quarantine."""

from rollout_service.engines.handle import EngineHandle
from rollout_service.engines.pool import EnginePool, NoEngineAvailable

__all__ = ["EngineHandle", "EnginePool", "NoEngineAvailable"]
