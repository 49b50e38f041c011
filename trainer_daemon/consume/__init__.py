"""Consuming the run's trajectory stream exactly once: bookkeeping (``state``), group
assembly (``groups``) and the JetStream consumer (``source``)."""

from trainer_daemon.consume.groups import GroupAssembler, Held, PendingGroup
from trainer_daemon.consume.source import TrajectorySource, consumer_limits
from trainer_daemon.consume.state import ConsumptionState

__all__ = ["ConsumptionState", "GroupAssembler", "Held", "PendingGroup", "TrajectorySource", "consumer_limits"]
