"""The end of a run's data: one message on the trajectory subject after the last trajectory.

The rollout service publishes it once its data is played out — its prompt stream exhausted
(or its verifiers driver finished), no agent in flight, its outbox empty (every trajectory
stored by JetStream) and no session open. Stream order makes it the last word: a trainer that
reads it has read every trajectory, so it trains the whole steps it can still form and
stops, instead of waiting for a batch that can no longer come (samples dropped as stale, or
groups left incomplete, leave fewer than ``total_rollout_steps`` — verl's fully async
trainer stops on its rollouter's end signal the same way).

Form: headers ``Asyncrl-End-Of-Data: <samples started>`` and ``Nats-Msg-Id:
<run id>.end-of-data`` (a repeat within the stream's duplicate window is dropped by the
server; a later repeat, after a restart of the service, is harmless: the trainer has
stopped, or counts it once), body ``{"samples": N, "trajectories": M}`` (informational).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

END_OF_DATA_HEADER = "Asyncrl-End-Of-Data"


def end_of_data_message(run_id: str, samples: int, trajectories: int) -> tuple[bytes, dict[str, str]]:
    """``(body, headers)`` of a run's end-of-data message."""
    body = json.dumps({"samples": samples, "trajectories": trajectories}).encode()
    return body, {END_OF_DATA_HEADER: str(samples), "Nats-Msg-Id": f"{run_id}.end-of-data"}


def is_end_of_data(headers: Mapping[str, str] | None) -> bool:
    return bool(headers) and END_OF_DATA_HEADER in headers
