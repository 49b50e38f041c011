"""NATS names of a run, derived from the run id in exactly one place.

For run id ``demo``::

    stream             ASYNCRL_DEMO            subjects asyncrl.demo.>
    trajectories       asyncrl.demo.traj       (trainer's durable consumer filters on it)
    dead letters       asyncrl.demo.dlq        (undecodable messages, copied by the trainer)
    metrics            asyncrl.demo.metrics.<component>
    environment calls  asyncrl.demo.env.<environment>
    KV: agents         ASYNCRL_DEMO_AGENTS     (checkpointed rollout agents)
    KV: sessions       ASYNCRL_DEMO_SESSIONS   (OpenAI-API sessions)
    KV: state          ASYNCRL_DEMO_STATE      (versions, sync records)
    KV: calls          ASYNCRL_DEMO_CALLS      (external tool calls and their results)
    trainer consumer   trainer

Run ids are validated by the config (``[a-z0-9][a-z0-9_-]*``), so every name is a legal
NATS subject token, stream name and bucket name. Only the trajectory and dead-letter
subjects are captured by the stream; metrics and environment announcements are core NATS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RUN_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class NatsNames:
    run_id: str

    def __post_init__(self) -> None:
        if not _RUN_ID.match(self.run_id):
            raise ValueError(f"run id {self.run_id!r} must match {_RUN_ID.pattern}")

    @property
    def _upper(self) -> str:
        return self.run_id.upper().replace("-", "_")

    @property
    def stream(self) -> str:
        return f"ASYNCRL_{self._upper}"

    @property
    def subject_prefix(self) -> str:
        return f"asyncrl.{self.run_id}"

    @property
    def trajectories(self) -> str:
        return f"{self.subject_prefix}.traj"

    @property
    def dead_letters(self) -> str:
        return f"{self.subject_prefix}.dlq"

    @property
    def stream_subjects(self) -> list[str]:
        return [self.trajectories, self.dead_letters]

    def metrics(self, component: str) -> str:
        return f"{self.subject_prefix}.metrics.{_token(component)}"

    def environment(self, env_name: str) -> str:
        return f"{self.subject_prefix}.env.{_token(env_name)}"

    @property
    def agents_bucket(self) -> str:
        return f"{self.stream}_AGENTS"

    @property
    def sessions_bucket(self) -> str:
        return f"{self.stream}_SESSIONS"

    @property
    def state_bucket(self) -> str:
        return f"{self.stream}_STATE"

    @property
    def calls_bucket(self) -> str:
        return f"{self.stream}_CALLS"

    @property
    def kv_buckets(self) -> list[str]:
        """Every KV bucket of the run."""
        return [self.agents_bucket, self.sessions_bucket, self.state_bucket, self.calls_bucket]

    @property
    def trainer_consumer(self) -> str:
        return "trainer"


def _token(name: str) -> str:
    if not _TOKEN.match(name):
        raise ValueError(f"{name!r} is not a valid NATS subject token (letters, digits, '-', '_')")
    return name
