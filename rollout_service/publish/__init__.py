"""Durable, exactly-once publishing of finished trajectories (outbox + JetStream)."""

from rollout_service.publish.outbox import Outbox, OutboxEntry
from rollout_service.publish.publisher import PublisherStats, TrajectoryPublisher

__all__ = ["Outbox", "OutboxEntry", "PublisherStats", "TrajectoryPublisher"]
