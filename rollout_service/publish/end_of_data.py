"""Telling the trainer that the data is played out (the message: :mod:`asyncrl.wire.end_of_data`).

The service checks :meth:`RolloutService.data_played_out` with its periodic metrics (every
``METRICS_INTERVAL_S``): the prompt stream exhausted (a verifiers source: its driver
finished), no agent in flight, the outbox empty (every trajectory stored by JetStream) and no
session open. :class:`EndOfDataNotice` then publishes the message once, on the trajectory
subject, after every trajectory; a failed publish (NATS down) is tried again at the next check.

Limits: external sessions opened after it are still served and published, but a trainer that
read the message may have stopped (it trains the whole steps it can form, then stops). A
restarted service sends the message again (the stream drops a repeat inside its duplicate
window; a trainer counts it once). While it waits unconsumed in the stream it is not a
trajectory: :meth:`unconsumed_share` tells the queue probe to leave it out.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from asyncrl.wire import end_of_data_message

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT_S = 10.0


class EndOfDataNotice:
    def __init__(self, run_id: str, subject: str, publish: Callable[..., Awaitable]) -> None:
        self.run_id, self.subject, self._publish = run_id, subject, publish
        self.sent = False

    async def send_once(self, samples: int, trajectories: int) -> bool:
        """Publish the message unless done already; True once it is stored."""
        if self.sent:
            return True
        body, headers = end_of_data_message(self.run_id, samples, trajectories)
        try:
            await self._publish(self.subject, body, headers=headers, timeout=PUBLISH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - NATS unreachable: the next check tries again
            log.warning("the end-of-data message was not published (%s); trying again", exc)
            return False
        self.sent = True
        log.info("data played out: end of data published after %d samples, %d trajectories", samples, trajectories)
        return True

    def unconsumed_share(self, undelivered: int) -> int:
        """How much of the stream's unconsumed count is this message (0 or 1): it is the last
        message, so it is unconsumed exactly while anything is undelivered."""
        return 1 if self.sent and undelivered > 0 else 0
