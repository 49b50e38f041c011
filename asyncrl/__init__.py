"""asyncrl: fully asynchronous RL for LLM agents, from plain services.

This package holds what every component shares: the CLI, the run config, the wire
contracts (Trajectory schema, NATS names), model loading and process launching. It must
not import the components' internals (rollout_service, trainer_daemon, sync_agent, ...)
except lazily from CLI subcommands.
"""

__version__ = "0.1.0"
