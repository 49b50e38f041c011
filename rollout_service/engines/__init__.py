"""Engines of the rollout service: routing with prefix affinity, health, quarantine."""

from rollout_service.engines.pool import EngineHandle, EnginePool, NoEngineAvailable

__all__ = ["EngineHandle", "EnginePool", "NoEngineAvailable"]
