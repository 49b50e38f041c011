"""SGLang release numbers as an engine reports them (``/server_info``'s ``version``).

``parse_version`` is the one parser (``asyncrl.sync_control.layout`` re-exports it). The client
adapts to a few releases itself: :data:`SESSIONS_FROM`, the first release with the weight-update
session routes (``/begin_weight_update``, ``/end_weight_update``); before it they do not exist,
and SGLang answers an unknown route as a normal one: with an admin key configured the admin key
gets 401 there, not 404.
"""

from __future__ import annotations

import re
from typing import Any

SESSIONS_FROM = (0, 5, 21)


def parse_version(raw: Any) -> tuple[int, int, int] | None:
    """``"0.5.23"`` / ``"0.5.23.post1"`` → (0, 5, 23); None when it is not a release number."""
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", str(raw or ""))
    return (int(m[1]), int(m[2]), int(m[3])) if m else None
