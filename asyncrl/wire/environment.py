"""The announcement of a tool call to an external environment (core NATS, best effort), typed
once for both ends (issue 68 item 4).

When an agent calls a tool served by an environment (``rollout.external_tools``), the rollout
service parks the call and publishes this on ``asyncrl.<run>.env.<environment>``
(:meth:`~asyncrl.wire.names.NatsNames.environment`) as JSON; the environment answers over HTTP
(``POST /v1/sessions/{session_id}/tool_results`` with ``token``, docs/rollout_service.md). An
environment that misses the announcement still finds the call by long-polling
``GET /v1/environments/{environment}/tool_calls``, which lists the same fields.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ToolCallAnnouncement(msgspec.Struct, kw_only=True, frozen=True):
    session_id: str
    token: str
    """The session-scoped token the result must carry."""
    tool_call_id: str
    name: str
    arguments: dict[str, Any]
    deadline: float
    """Unix time after which a result is refused (409) and the call ends by its ``on_timeout``."""
    environment: str

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> ToolCallAnnouncement:
        return msgspec.json.decode(data, type=cls)
