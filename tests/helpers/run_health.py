"""What an operator would check after a fault, as test waits: the ``health`` blocks of the
rollout service's ``/admin/status`` and the sync agent's ``/status`` (see
rollout_service/api/run_health.py and sync_agent/health.py).

``wait_rollout_health(url, admin_token, states)`` waits until the rollout says one of
``states``; ``wait_run_healthy(...)`` until the run is what an operator calls healthy:
the rollout ``progressing`` (tokens decoded in its window) with no warnings, not paused,
every engine healthy; and, given the agent's URL, the agent with nothing to reload, no
push wanted and no stuck or warning entry. Each returns the status documents it accepted.
"""

from __future__ import annotations

import httpx

from tests.helpers.waiting import wait_for


async def get_json(url: str, token: str | None) -> dict:
    async with httpx.AsyncClient(timeout=10) as http:
        resp = await http.get(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp.raise_for_status()
        return resp.json()


async def wait_rollout_health(rollout_url: str, admin_token: str | None, states: tuple[str, ...], timeout_s: float,
                              what: str) -> dict:
    async def check():
        status = await get_json(f"{rollout_url}/admin/status", admin_token)
        return status if status["health"]["state"] in states else None
    return await wait_for(check, timeout_s, what, retry_on=(httpx.HTTPError,))


def _rollout_healthy(status: dict) -> bool:
    h = status["health"]
    return (h["state"] == "progressing" and not h["warnings"] and not status["paused"]
            and all(e["state"] == "healthy" for e in status["engines"]))


def _agent_healthy(status: dict) -> bool:
    h = status["health"]
    return (not status["needs_reload"] and status["push_wanted"] is False and "stuck" not in h and "warnings" not in h
            and h["state"] in ("progressing", "idle", "starting"))


async def wait_run_healthy(rollout_url: str, admin_token: str | None, timeout_s: float, agent_url: str | None = None,
                           sync_token: str | None = None) -> tuple[dict, dict | None]:
    """Wait until the run is healthy (module docstring); returns (rollout status, agent status)."""
    async def check():
        rollout = await get_json(f"{rollout_url}/admin/status", admin_token)
        if not _rollout_healthy(rollout):
            return None
        if agent_url is None:
            return rollout, None
        agent = await get_json(f"{agent_url}/status", sync_token)
        return (rollout, agent) if _agent_healthy(agent) else None
    return await wait_for(check, timeout_s, "the run to be healthy (rollout progressing, no warnings; agent: nothing to reload)",
                          retry_on=(httpx.HTTPError,))
