"""``asyncrl up`` starts nothing open (issue 30 item 11): the local engines it starts require a
generated key and its embedded NATS a generated user and password; the services it starts get
them through the run's private config file."""

from __future__ import annotations

import asyncio

import httpx
import nats.errors
import pytest
import yaml

from asyncrl.config import load_config
from asyncrl.jetstream import connect
from launcher.up.stack import Stack


async def test_up_generates_an_engine_key_and_nats_credentials(tmp_path):
    cfg = load_config(overrides=[f"run.dir={tmp_path / 'run'}", "run.id=up-secrets", "model.path=builtin:tiny",
                                 "rollout.tools=[]", "engines.num_local=1", "rollout.port=0", "sync.port=0",
                                 "trainer.metrics_port=0", "rollout.total_rollout_steps=1"], environ={})
    stack = Stack(cfg, tmp_path / "run")
    try:
        await asyncio.to_thread(stack.start, lambda m: None, False)
        doc = yaml.safe_load((stack.run_dir / "config.yaml").read_text())
        key, auth = doc["engines"]["api_key"], stack.nats_auth()
        assert key and len(key) >= 24 and auth["user"] and len(auth["password"]) >= 24
        assert (stack.run_dir / "config.yaml").stat().st_mode & 0o077 == 0
        (engine,) = doc["engines"]["urls"]
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.get(f"{engine}/model_info")).status_code == 401
            assert (await http.get(f"{engine}/model_info", headers={"Authorization": f"Bearer {key}"})).status_code == 200
            assert (await http.post(f"{engine}/pause_generation", json={})).status_code == 401
        with pytest.raises((nats.errors.Error, OSError)):
            await asyncio.wait_for(connect(stack.urls["nats"], "outsider", persistent=False), 30)
        nc = await connect(stack.urls["nats"], "insider", persistent=False, **auth)
        await nc.close()
    finally:
        await asyncio.to_thread(stack.stop)
