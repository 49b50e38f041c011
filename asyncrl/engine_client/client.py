"""The one async client every asyncrl component uses to talk to an inference engine.

It speaks the SGLang HTTP subset in ``shared/reference/sglang_contract.md`` and works
against real SGLang servers (old and new, see §9 there) and ``local_engine``. aiohttp, not
httpx: at concurrency 64 against a trivial FastAPI server aiohttp does ~15x the requests
per second on this hardware (``bench/http_client.py``; numbers in docs/benchmarks.md).

Contract:

- one aiohttp session per client; use ``async with EngineClient(...) as c`` (or call
  :meth:`close`). Safe to share between tasks of one event loop.
- every call has a timeout: ``request_timeout_s`` for ``/generate``, ``control_timeout_s``
  for the rest; each method takes ``timeout_s`` to override.
- failures raise :class:`EngineHTTPError` (status + the engine's message from any of its
  error shapes), :class:`EngineTimeout` or :class:`EngineUnavailable` — all
  :class:`EngineError`. An aborted generation is *not* an error: it returns a
  :class:`GenerateResult` whose ``finish_reason.type`` is ``"abort"``.
- admin routes (weights, pause, continue, abort, flush) send ``admin_api_key`` when set,
  else ``api_key``; every other route sends ``api_key``.
- version drift: ``pause("abort")`` and ``resume()`` fall back to an empty body on
  400/405/415/422 from servers that take none; ``/model_info``, ``/server_info``, ``/v1/loads`` fall back to their ``/get_*``
  aliases on 404; ``begin_weight_update`` / ``end_weight_update`` return False on 404
  (SGLang 0.5.20 and older have no weight-update sessions and need none).
- aborts are by exact rid or ``abort_all`` (SGLang ignores a rid it does not track exactly).

Not here: choosing an engine, retries of generations, rollout logic — the rollout
service owns those.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import orjson

from asyncrl.engine_client.errors import (
    EngineError,
    EngineHTTPError,
    EngineTimeout,
    EngineUnavailable,
    error_message,
)
from asyncrl.engine_client.release import SESSIONS_FROM, parse_version
from asyncrl.engine_client.types import GenerateResult, WeightsCheck
from asyncrl.http.keepalive import client_session
from asyncrl.wire.sync import DEFAULT_GROUP_NAME, weight_version_label, weight_version_number

SERVER_INFO_SECRETS = ("api_key", "admin_api_key")
"""Keys SGLang's ``/server_info`` answers in clear; :meth:`EngineClient.server_info` drops them."""
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # a long agent turn on a slow engine; callers set their own
DEFAULT_CONTROL_TIMEOUT_S = 120.0  # group init blocks until every rank joins (prime-rl PR #2673: 120 s)
DEFAULT_MAX_CONNECTIONS = 1024  # concurrent requests per client; aiohttp's default of 100 throttles rollouts
FALLBACK_STATUSES = (400, 405, 415, 422)  # what an old server says to a body it does not take

_NO_BODY = object()


class EngineClient:
    """Async client for one engine's base URL (``http://host:port``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.max_connections = max_connections
        self._sessions = True
        """Whether the engine has weight-update sessions, as read at the last ``begin_weight_update``."""
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineClient:
        self._ensure_session()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # idle connections dropped before the server closes them (asyncrl.http.keepalive)
            self._session = client_session(limit=self.max_connections, json_serialize=lambda o: orjson.dumps(o).decode())
        return self._session

    # -- plumbing ------------------------------------------------------------------------
    def _headers(self, admin: bool) -> dict[str, str]:
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = _NO_BODY,
        *,
        admin: bool = False,
        timeout_s: float | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        """One HTTP call; returns the parsed body (JSON, else text, else None)."""
        url = self.base_url + path
        headers = self._headers(admin)
        data = None
        if body is not _NO_BODY:
            data = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
        limit = self.control_timeout_s if timeout_s is None else timeout_s
        session = self._ensure_session()
        try:
            async with session.request(
                method, url, data=data, headers=headers, params=params, timeout=aiohttp.ClientTimeout(total=limit),
                allow_redirects=False,  # keys and bodies (adapter tensors) go to the engine's URL only (issue 67 L2)
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            raise EngineTimeout(f"{method} {url} got no answer within {limit:g} s") from None
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        try:
            parsed: Any = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            parsed = raw.decode("utf-8", errors="replace")
        if not 200 <= status < 300:
            raise EngineHTTPError(status, error_message(parsed, fallback=f"HTTP {status}"), url, parsed)
        return parsed

    @staticmethod
    def _checked(body: Any, what: str) -> dict[str, Any]:
        """Weight routes answer ``{"success": bool, ...}``; a 200 with success false is an error too."""
        if not isinstance(body, dict):
            raise EngineError(f"{what}: unexpected answer {body!r}")
        if body.get("success") is False:
            raise EngineHTTPError(200, error_message(body, fallback=f"{what} failed"), body=body)
        return body

    async def _get_with_alias(self, path: str, alias: str, timeout_s: float | None) -> Any:
        try:
            return await self._call("GET", path, timeout_s=timeout_s)
        except EngineHTTPError as exc:
            if exc.status != 404:
                raise
            return await self._call("GET", alias, timeout_s=timeout_s)

    # -- generation ----------------------------------------------------------------------
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
        *,
        timeout_s: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> GenerateResult:
        """One ``/generate`` by token ids (n=1). ``rid`` defaults to a fresh uuid4 hex."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "rid": rid or uuid.uuid4().hex,
            **(extra or {}),
        }
        out = await self._call("POST", "/generate", body, timeout_s=self.request_timeout_s if timeout_s is None else timeout_s)
        if not isinstance(out, dict):
            raise EngineError(f"/generate returned {type(out).__name__}, expected one object")
        return GenerateResult.parse(out)

    async def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
        *,
        timeout_s: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> AsyncIterator[GenerateResult]:
        """``/generate`` with ``stream: true``: yields the cumulative result after each SSE
        chunk (SGLang's default cumulative streaming); the last one carries the finish reason.
        An error chunk raises :class:`EngineHTTPError`. Closing the iterator early closes the
        connection, which aborts the request on the engine."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob, "rid": rid or uuid.uuid4().hex, "stream": True, **(extra or {}),
        }
        url = self.base_url + "/generate"
        limit = self.request_timeout_s if timeout_s is None else timeout_s
        session = self._ensure_session()
        try:
            async with session.post(url, data=orjson.dumps(body), headers={**self._headers(False), "Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=limit), allow_redirects=False) as resp:
                if resp.status != 200:
                    raw = await resp.read()
                    try:
                        parsed: Any = orjson.loads(raw)
                    except orjson.JSONDecodeError:
                        parsed = raw.decode("utf-8", errors="replace")
                    raise EngineHTTPError(resp.status, error_message(parsed, fallback=f"HTTP {resp.status}"), url, parsed)
                async for raw_line in resp.content:
                    line = raw_line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        err = chunk["error"]
                        raise EngineHTTPError(int(err.get("code", 500)), error_message(chunk), url, chunk)
                    yield GenerateResult.parse(chunk)
        except TimeoutError:
            raise EngineTimeout(f"POST {url} (stream) got no answer within {limit:g} s") from None
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"POST {url} (stream): {type(exc).__name__}: {exc}") from exc

    async def abort(self, rid: str | None = None, abort_all: bool = False, *, timeout_s: float | None = None) -> None:
        """Abort the request with exactly this ``rid``, or all of them (``abort_all``).

        SGLang's tokenizer drops a rid it does not track exactly (200, nothing aborted), so a
        prefix aborts nothing; its scheduler then matches by prefix, so rids must be chosen
        so that no live rid is a prefix of another. A rid that already finished (or that the
        engine has not registered yet) is a no-op: callers that must stop a request re-send."""
        if not rid and not abort_all:
            raise ValueError("give a rid or abort_all=True")
        body: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
        await self._call("POST", "/abort_request", body, admin=True, timeout_s=timeout_s)

    # -- pause / resume / cache ----------------------------------------------------------
    async def _post_with_body_fallback(self, path: str, body: dict[str, Any], timeout_s: float | None) -> Any:
        try:
            return await self._call("POST", path, body, admin=True, timeout_s=timeout_s)
        except EngineHTTPError as exc:
            if exc.status not in FALLBACK_STATUSES:
                raise
            return await self._call("POST", path, admin=True, timeout_s=timeout_s)

    async def pause(self, mode: str = "abort", *, timeout_s: float | None = None) -> None:
        """``/pause_generation`` with ``{"mode": mode}`` (``abort`` | ``retract`` | ``in_place``).

        Only ``abort`` falls back to an empty body: old servers pause that way only, and a
        refused ``in_place`` must not silently become an abort."""
        if mode == "abort":
            await self._post_with_body_fallback("/pause_generation", {"mode": mode}, timeout_s)
        else:
            await self._call("POST", "/pause_generation", {"mode": mode}, admin=True, timeout_s=timeout_s)

    async def resume(self, *, timeout_s: float | None = None) -> None:
        """``/continue_generation``."""
        await self._post_with_body_fallback("/continue_generation", {}, timeout_s)

    async def flush_cache(self, retries: int = 60, interval_s: float = 1.0, *, timeout_s: float | None = None,
                          wait_s: float = 0.0) -> None:
        """``/flush_cache``, retried while the engine answers 400 (requests pending). ``wait_s`` > 0
        asks the engine to wait that long for itself to be idle (``?timeout=``, SGLang 0.5.15+:
        it flushes the moment nothing runs or waits, paused or not) before it answers."""
        last: EngineHTTPError | None = None
        params = {"timeout": f"{wait_s:g}"} if wait_s > 0 else None
        http_timeout = None if timeout_s is None else timeout_s + wait_s
        for attempt in range(max(1, retries)):
            try:
                await self._call("GET", "/flush_cache", admin=True, timeout_s=http_timeout, params=params)
                return
            except EngineHTTPError as exc:
                if exc.status != 400:
                    raise
                last = exc
            if attempt + 1 < retries:
                await asyncio.sleep(interval_s)
        assert last is not None
        raise EngineHTTPError(400, f"cache not flushed after {retries} tries: {last.message}", last.url, last.body)

    # -- weights -------------------------------------------------------------------------
    async def _session_call(self, path: str, timeout_s: float | None) -> bool:
        if path == "/begin_weight_update":  # the engine's release says whether it has sessions
            release = parse_version((await self.server_info(timeout_s=timeout_s)).get("version"))
            self._sessions = release is None or release >= SESSIONS_FROM
        if not self._sessions:
            # SGLang 0.5.20 and older: no such routes, none needed; calling them anyway, its auth
            # takes an unknown route for a normal one and refuses the admin key with 401 (a real
            # 0.5.18 server did: tests/sglang/test_sync_policies.py)
            return False
        try:
            self._checked(await self._call("POST", path, {}, admin=True, timeout_s=timeout_s), path.lstrip("/"))
        except EngineHTTPError as exc:
            if exc.status == 404:
                return False  # a server without the routes that did not say its release
            raise
        return True

    async def begin_weight_update(self, *, timeout_s: float | None = None) -> bool:
        """Open the engine's weight-update session (SGLang 0.5.21+ refuses updates outside
        one). False: the server has no such route (an older release, as its ``/server_info``
        says, or a 404) and needs none; ``end_weight_update`` then calls nothing either. An open
        session answers 400 "already open": end it and begin again."""
        return await self._session_call("/begin_weight_update", timeout_s)

    async def end_weight_update(self, *, timeout_s: float | None = None) -> bool:
        """Close the weight-update session (also after a failed update). False: no such route;
        400 when no session is open."""
        return await self._session_call("/end_weight_update", timeout_s)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "gloo",
        *,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Join the weight group; returns when the engine's side has formed it."""
        body = {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        }
        return self._checked(await self._call("POST", "/init_weights_update_group", body, admin=True, timeout_s=timeout_s), "init_weights_update_group")

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        weight_version: int | None = None,
        load_format: str | None = None,
        flush_cache: bool | None = None,
        abort_all_requests: bool | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Receive one bucket; the engine answers after its broadcasts finished."""
        body: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes], "group_name": group_name}
        label = None if weight_version is None else weight_version_label(weight_version)
        for key, value in (("weight_version", label), ("load_format", load_format), ("flush_cache", flush_cache), ("abort_all_requests", abort_all_requests)):
            if value is not None:
                body[key] = value
        return self._checked(await self._call("POST", "/update_weights_from_distributed", body, admin=True, timeout_s=timeout_s), "update_weights_from_distributed")

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME, *, timeout_s: float | None = None) -> dict[str, Any]:
        body = {"group_name": group_name}
        return self._checked(await self._call("POST", "/destroy_weights_update_group", body, admin=True, timeout_s=timeout_s), "destroy_weights_update_group")

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None, *, abort_all_requests: bool = False,
        flush_cache: bool = False, timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Reload every weight from a model directory. ``flush_cache`` defaults to False (not
        SGLang's True): with requests still running or queued, SGLang 0.5.22+ fails the call
        after loading and 0.5.21 and older crash on an assert; call :meth:`flush_cache` after."""
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version_label(weight_version)
        return self._checked(await self._call("POST", "/update_weights_from_disk", body, admin=True, timeout_s=timeout_s), "update_weights_from_disk")

    async def update_weight_version(self, new_version: int, abort_all_requests: bool = True, *, timeout_s: float | None = None) -> dict[str, Any]:
        body = {"new_version": weight_version_label(new_version), "abort_all_requests": abort_all_requests}
        return self._checked(await self._call("POST", "/update_weight_version", body, admin=True, timeout_s=timeout_s), "update_weight_version")

    # -- LoRA adapters -------------------------------------------------------------------
    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False,
                                timeout_s: float | None = None) -> dict[str, Any]:
        """Load a peft adapter directory the engine can read as ``name`` (``LoRAUpdateOutput``)."""
        body = {"lora_name": name, "lora_path": path, "pinned": pinned}
        return self._checked(await self._call("POST", "/load_lora_adapter", body, admin=True, timeout_s=timeout_s), "load_lora_adapter")

    async def load_lora_adapter_from_tensors(self, name: str, config: dict[str, Any], payload: str,
                                             checksums: dict[str, str] | None = None, *, named: bool = True,
                                             tp_size: int = 1, timeout_s: float | None = None) -> dict[str, Any]:
        """Load an adapter from its tensors (``payload``: base64 of a pickle of name → CPU
        tensor, :func:`asyncrl.weight_sync.adapter.encode_adapter`); ``named``: SGLang 0.5.17+'s
        ``serialized_named_tensors``, one copy per TP rank (``tp_size``, from ``/server_info``:
        rank r reads entry r, and a shorter list makes rank 1 raise and the server exit), else
        0.5.15/0.5.16's ``serialized_tensors`` (one string every rank reads)."""
        if tp_size < 1:
            raise ValueError(f"tp_size must be at least 1, got {tp_size}")
        body: dict[str, Any] = {"lora_name": name, "config_dict": config}
        body |= {"serialized_named_tensors": [payload] * tp_size} if named else {"serialized_tensors": payload}
        if checksums is not None:
            body["expected_checksums"] = checksums
        return self._checked(await self._call("POST", "/load_lora_adapter_from_tensors", body, admin=True, timeout_s=timeout_s),
                             "load_lora_adapter_from_tensors")

    async def lora_adapters(self, *, timeout_s: float | None = None) -> list[str]:
        """Names of the adapters loaded (``/v1/models`` cards with a ``parent``, as SGLang lists them)."""
        body = await self._call("GET", "/v1/models", timeout_s=timeout_s)
        cards = body.get("data", []) if isinstance(body, dict) else []
        return [c["id"] for c in cards if isinstance(c, dict) and c.get("parent") and isinstance(c.get("id"), str)]

    async def unload_lora_adapter(self, name: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Unload ``name``; SGLang answers once no request uses it any more."""
        body = {"lora_name": name}
        return self._checked(await self._call("POST", "/unload_lora_adapter", body, admin=True, timeout_s=timeout_s), "unload_lora_adapter")

    # -- info ----------------------------------------------------------------------------
    async def model_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return await self._get_with_alias("/model_info", "/get_model_info", timeout_s)

    async def weights_checksum(self, *, timeout_s: float | None = None) -> dict[str, Any] | None:
        """local_engine's ``{"weight_version", "checksum", "parameters"}`` (``asyncrl.weight_sync.checksum``);
        None from an engine without the route (SGLang answers 404)."""
        try:
            return await self._call("GET", "/weights_checksum", timeout_s=timeout_s)
        except EngineHTTPError as exc:
            if exc.status == 404:
                return None
            raise

    async def check_weights(self, *, timeout_s: float | None = None) -> WeightsCheck | None:
        """``POST /weights_checker {"action": "checksum"}`` (SGLang 0.5.15+, local_engine): the
        engine hashes every weight it serves. None from a server without the route (404); an
        engine whose check failed answers 400 (raised)."""
        try:
            body = await self._call("POST", "/weights_checker", {"action": "checksum"}, admin=True, timeout_s=timeout_s)
        except EngineHTTPError as exc:
            if exc.status == 404:
                return None
            raise
        return WeightsCheck.parse(body)

    async def weight_version(self, *, timeout_s: float | None = None) -> int | None:
        """The engine's weight version (``/model_info``) as a number; None when it reports none."""
        version = (await self.model_info(timeout_s=timeout_s)).get("weight_version")
        return None if version is None else weight_version_number(version)

    async def server_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The engine's ``/server_info``, without ``api_key`` and ``admin_api_key``: SGLang
        answers both in clear (every release), and nothing here needs them or may log them."""
        info = await self._get_with_alias("/server_info", "/get_server_info", timeout_s)
        if isinstance(info, dict):
            for key in SERVER_INFO_SECRETS:
                info.pop(key, None)
        return info

    async def loads(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return await self._get_with_alias("/v1/loads", "/get_load", timeout_s)

    async def health(self, *, timeout_s: float | None = None) -> bool:
        """``GET /health``: True on 200, False on 5xx; raises :class:`EngineUnavailable` /
        :class:`EngineTimeout` when it cannot ask. On SGLang this is a one-token generation
        by default (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=1``) that waits behind a pause
        for up to 20 s; see :meth:`health_generate` and :meth:`alive`."""
        return await self._probe("/health", timeout_s)

    async def health_generate(self, *, timeout_s: float | None = None) -> bool:
        """``GET /health_generate``: the engine can generate (a one-token request when idle).
        Blocks while the engine is paused (SGLang: up to 20 s, then 503): give it a timeout
        above that, and do not use it to judge an engine paused for a weight sync."""
        return await self._probe("/health_generate", timeout_s)

    async def alive(self, *, timeout_s: float | None = None) -> bool:
        """The HTTP server answers (``/model_info``; never waits for the scheduler or a pause)."""
        try:
            await self.model_info(timeout_s=timeout_s)
            return True
        except EngineHTTPError as exc:
            if exc.status >= 500:
                return False
            raise

    async def _probe(self, path: str, timeout_s: float | None) -> bool:
        try:
            await self._call("GET", path, timeout_s=timeout_s)
            return True
        except EngineHTTPError as exc:
            if exc.status >= 500:
                return False
            raise
