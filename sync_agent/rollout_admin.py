"""The sync agent's client for the rollout service's admin API (bearer admin token): the
requests and the answer are :mod:`asyncrl.wire.rollout_admin`, the models the server uses."""

from __future__ import annotations

from typing import Any

import aiohttp
from pydantic import BaseModel, ValidationError

from asyncrl.http.keepalive import client_session
from asyncrl.wire.rollout_admin import (
    PauseMode,
    PauseRequest,
    QuarantineRequest,
    ResumeRequest,
    RolloutStatus,
)


class RolloutAdminError(RuntimeError):
    """The rollout service refused or did not answer an admin call."""


class RolloutAdmin:
    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = client_session()
        return self._session

    async def _call(self, method: str, path: str, body: BaseModel | None = None,
                    timeout_s: float | None = None) -> RolloutStatus:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        payload: Any = None
        try:
            async with self._http().request(method, self.url + path, json=body.model_dump(mode="json") if body else None,
                                            headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)) as resp:
                payload = await resp.json(content_type=None)
                if resp.status != 200:
                    message = (payload or {}).get("error", {}).get("message", str(payload)) if isinstance(payload, dict) else str(payload)
                    raise RolloutAdminError(f"{method} {path}: HTTP {resp.status}: {message}")
                return RolloutStatus.model_validate(payload)
        except ValidationError as exc:
            raise RolloutAdminError(f"{method} {path}: not a rollout status: {exc.errors()[:3]}") from exc
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise RolloutAdminError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc

    async def status(self) -> RolloutStatus:
        return await self._call("GET", "/admin/status")

    async def pause(self, mode: PauseMode, timeout_s: float, version: int | None = None) -> RolloutStatus:
        """``version``: the version the sync will install (a ``per_request`` pause judges by it)."""
        return await self._call("POST", "/admin/pause", PauseRequest(mode=mode, timeout_s=timeout_s, version=version),
                                timeout_s=timeout_s + 10)

    async def resume(self, version: int) -> RolloutStatus:
        return await self._call("POST", "/admin/resume", ResumeRequest(version=version))

    async def quarantine(self, engine_id: str, reason: str) -> RolloutStatus:
        return await self._call("POST", f"/admin/engines/{engine_id}/quarantine", QuarantineRequest(reason=reason[:500]))

    async def release(self, engine_id: str) -> RolloutStatus:
        return await self._call("DELETE", f"/admin/engines/{engine_id}/quarantine")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
