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


def _secret_fields(model_cls, prefix=()):
    """Every ``SecretStr`` field of a config model, as dotted paths (nested sections walked)."""
    import types
    import typing

    from pydantic import BaseModel, SecretStr
    for name, field in model_cls.model_fields.items():
        ann = field.annotation
        optional = typing.get_origin(ann) in (typing.Union, types.UnionType) and SecretStr in typing.get_args(ann)
        if ann is SecretStr or optional:
            yield (*prefix, name)
        elif isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _secret_fields(ann, (*prefix, name))


def test_every_configured_secret_reaches_the_services_in_clear(tmp_path):
    """Issue 45: ``asyncrl up`` wrote ``engines.admin_api_key`` as ``**********`` (the masked
    display value) into the file the services read, so every sync was refused with 401. Every
    secret field of the run config, set by the user, must reach the children as its own value,
    from every launcher that writes a configuration (up's Stack and slurm's job document)."""
    from asyncrl.config import RunConfig, revealed_document
    paths = list(_secret_fields(RunConfig))
    assert ("engines", "admin_api_key") in paths and ("security", "admin_token") in paths
    overrides = [f"{'.'.join(p)}=secret-{'-'.join(p)}-0123456789abcdef" for p in paths]
    overrides.append("security.environment_tokens={arith: secret-env-arith-0123456789abcdef}")
    cfg = load_config(overrides=[f"run.dir={tmp_path / 'run'}", "model.path=builtin:tiny", *overrides,
                                 "engines.backend=sglang", "engines.urls=[http://127.0.0.1:9]"], environ={})
    stack = Stack(cfg, tmp_path / "run")
    stack.write_config(stack.resolve())
    written = yaml.safe_load((stack.run_dir / "config.yaml").read_text())
    for doc in (written, revealed_document(cfg)):
        assert "**********" not in yaml.safe_dump(doc)
        for p in paths:
            node = doc
            for part in p:
                node = node[part]
            assert node == f"secret-{'-'.join(p)}-0123456789abcdef", p
        assert doc["security"]["environment_tokens"] == {"arith": "secret-env-arith-0123456789abcdef"}
    # and the services read it back as the same values
    again = load_config(stack.run_dir / "config.yaml", environ={})
    assert again.engines.admin_api_key.get_secret_value() == "secret-engines-admin_api_key-0123456789abcdef"
