"""Info, health and CLI routes of a real engine."""

from __future__ import annotations

import subprocess
import sys

import aiohttp

CLI_TIMEOUT_S = 120


async def test_info_routes_and_aliases(engine):
    async with aiohttp.ClientSession() as s:
        for a, b in (("/model_info", "/get_model_info"),):
            async with s.get(engine.url + a) as ra, s.get(engine.url + b) as rb:
                ja, jb = await ra.json(), await rb.json()
                assert ra.status == rb.status == 200 and ja == jb
        async with s.get(engine.url + "/get_load") as r:  # removed in 0.5.21; the default emulates 0.5.23
            assert r.status == 404 and await r.json() == {"detail": "Not Found"}
        async with s.get(f"{engine.url}/server_info") as r:
            info = await r.json()
        assert info["model_path"] == "builtin:tiny" and info["weight_version"] == "default" and info["tp_size"] == 1
        assert "api_key" not in info and "admin_api_key" not in info
        assert info["internal_states"][0]["paused"] is False and info["context_length"] == 4096
        async with s.get(f"{engine.url}/v1/models") as r:
            models = await r.json()
        assert models["object"] == "list" and models["data"][0]["id"] == "builtin:tiny"
        async with s.get(f"{engine.url}/health_generate") as r:
            assert r.status == 200
        async with s.get(f"{engine.url}/metrics") as r:
            text = await r.text()
        assert "sglang:num_running_reqs" in text and 'local_engine_weight_version_info{version="default"} 1.0' in text


def test_cli_refuses_bad_model_and_settings_cleanly():
    for args in (["--model", "builtin:nope"], ["--max-batch-size", "0"]):
        out = subprocess.run([sys.executable, "-m", "local_engine", "--port", "1", *args], capture_output=True, text=True,
                             timeout=CLI_TIMEOUT_S)
        assert out.returncode == 2 and "Traceback" not in out.stderr and "asyncrl engine:" in out.stderr
