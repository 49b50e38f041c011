"""asyncrl.http.keepalive: every asyncrl client drops idle connections before any asyncrl
server (or SGLang's uvicorn, 5 s) closes them — the race that reset the trainer's POST
/v1/syncs under load. Checked on the source: no product module opens its own aiohttp session
or starts uvicorn without the shared keep-alive."""

import re
from pathlib import Path

import pytest

from asyncrl.http.keepalive import CLIENT_KEEPALIVE_S, SERVER_KEEP_ALIVE_S, client_session

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("asyncrl", "rollout_service", "sync_agent", "trainer_daemon", "local_engine", "tools")
UVICORN_DEFAULT_KEEP_ALIVE_S = 5  # what SGLang's server (uvicorn) uses


def sources():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_clients_let_go_well_before_servers():
    assert CLIENT_KEEPALIVE_S < UVICORN_DEFAULT_KEEP_ALIVE_S < SERVER_KEEP_ALIVE_S


async def test_client_session_uses_the_short_keepalive():
    async with client_session(limit=7) as s:
        assert s.connector._keepalive_timeout == CLIENT_KEEPALIVE_S and s.connector.limit == 7


@pytest.mark.parametrize("pattern, where", [
    (r"aiohttp\.ClientSession\(", "asyncrl/http/keepalive.py"),
    (r"httpx\.(Async)?Client\(", None),
])
def test_no_module_opens_its_own_client_session(pattern, where):
    found = [str(p.relative_to(ROOT)) for p in sources() if re.search(pattern, p.read_text())]
    assert found == ([where] if where else []), f"{pattern} outside asyncrl.http.keepalive: {found}"


def test_every_uvicorn_server_sets_the_keep_alive():
    servers = 0
    for p in sources():
        text = p.read_text()
        calls = len(re.findall(r"uvicorn\.(?:run|Config)\(", text))
        servers += calls
        assert text.count("timeout_keep_alive=SERVER_KEEP_ALIVE_S") == calls, p.relative_to(ROOT)
    assert servers >= 3  # local_engine, the rollout service, the sync agent
