"""Bounds on what clients hold open at once (issue 30 item 11): stateless completions in
progress and tool-call long-polls. Sessions are bounded by ``api.max_sessions`` and their
metadata by ``api.max_session_metadata_bytes`` (checked where a session is created).

``InflightLimit(limit, what).take()`` counts one more request in progress and returns its
``release`` (idempotent); above the limit it raises a 429 with ``Retry-After`` before any work
is done. :func:`hold_until_sent` keeps a streaming response's slot until its last byte is sent
or the client goes away (the body iterator's ``finally``); any other response releases at once.
One event loop: plain counters, no locks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from asyncrl.http.errors import ApiError

RETRY_AFTER_S = "2"


class InflightLimit:
    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what, self.active = limit, what, 0

    def take(self) -> Callable[[], None]:
        if self.active >= self.limit:
            raise ApiError(429, f"{self.active} {self.what} in progress (limit {self.limit}); retry shortly",
                           headers={"Retry-After": RETRY_AFTER_S})
        self.active += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active -= 1

        return release


def hold_until_sent(response, release: Callable[[], None]):
    """``response`` with its slot released when it is done being sent (see the module docstring)."""
    if not isinstance(response, StreamingResponse):
        release()
        return response
    body = response.body_iterator

    async def sent() -> AsyncIterator:
        try:
            async for chunk in body:
                yield chunk
        finally:
            release()

    response.body_iterator = sent()
    return response
