"""Off loopback, nothing runs open (issue 30 item 3): the rollout service refuses to bind a
non-loopback address without a data-plane token, and ``--insecure-dev`` (no admin or sync
token) binds loopback only, in the rollout service and in the sync agent."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl.http.binding import is_loopback_bind
from rollout_service.api.auth import InsecureConfig, check_tokens

ADMIN = "admin-token-0123456789"
API = "data-plane-token-0123456789"


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.0.1.7", True), ("::1", True), ("[::1]", True),
                                                ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False),
                                                ("10.1.2.3", False), ("rollout", False), ("localhost.evil.com", False)])
def test_loopback_binds(host: str, loopback: bool):
    assert is_loopback_bind(host) is loopback


def test_the_data_plane_needs_a_token_off_loopback_and_insecure_dev_stays_on_loopback():
    check_tokens(ADMIN, None, False, "127.0.0.1")  # an open data plane on loopback: allowed (local use)
    check_tokens(None, None, True, "127.0.0.1")  # --insecure-dev on loopback: allowed
    check_tokens(ADMIN, API, False, "0.0.0.0")  # both tokens off loopback: allowed
    for admin, api, dev, fragment in [(ADMIN, None, False, "security.api_token"), (ADMIN, "short", False, "security.api_token"),
                                      (ADMIN, API, True, "loopback only"), (None, None, True, "loopback only")]:
        with pytest.raises(InsecureConfig, match=fragment):
            check_tokens(admin, api, dev, "0.0.0.0")


def _refused(argv: list[str], env_tokens: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "launcher", *argv], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", **env_tokens})
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    return done.stderr


def test_the_services_refuse_to_start_open_off_loopback(tmp_path):
    run = [f"run.dir={tmp_path / 'run'}"]
    err = _refused(["rollout", *run, "--host", "0.0.0.0"], {"ASYNCRL_SECURITY__ADMIN_TOKEN": ADMIN})
    assert "refusing to start" in err and "security.api_token" in err and "non-loopback" in err
    err = _refused(["rollout", *run, "--host", "0.0.0.0", "--insecure-dev"], {})
    assert "refusing to start" in err and "loopback only" in err
    err = _refused(["sync-agent", *run, "--host", "0.0.0.0", "--insecure-dev"], {})
    assert "refusing to start" in err and "loopback only" in err


def test_the_local_engine_refuses_to_start_open_off_loopback():
    """Issue 48 item 11: ``asyncrl engine`` off loopback without its key (or with a short one)
    exits 2 naming the key, before loading a model."""
    for env in ({}, {"LOCAL_ENGINE_API_KEY": "short"}):
        err = _refused(["engine", "--model", "builtin:tiny", "--host", "0.0.0.0", "--port", "1"], env)
        assert "refusing to start" in err and "LOCAL_ENGINE_API_KEY" in err and "non-loopback" in err
