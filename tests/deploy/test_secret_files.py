"""compose's secret files (issue 30 item 8): docker/make-secrets.sh, which writes them, and the
entry points that read them where no config loader does (docker/nats/entrypoint.sh,
docker/sglang/engine.sh). The wiring in compose.yaml is tests/deploy/test_compose.py's; the
stack running on them under Docker is tests/deploy/test_compose_run.py's."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from tests.deploy.conftest import REPO, SECRET_NAMES, make_secrets


def test_make_secrets_writes_one_private_random_file_per_secret(tmp_path):
    values = make_secrets(tmp_path / "secrets")
    directory = tmp_path / "secrets"
    assert sorted(p.name for p in directory.iterdir()) == sorted(SECRET_NAMES)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700  # only its owner on the host
    for name in SECRET_NAMES:
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o444, name  # any container user reads it
        assert "\n" not in values[name] and len(values[name]) >= 48, name
    assert all(values[n].startswith("nats-") for n in SECRET_NAMES if n.startswith("nats_"))  # nats.conf: a bare value
    assert len(set(values.values())) == len(SECRET_NAMES)  # the admin token is never the API token


def test_make_secrets_keeps_what_exists_and_moves_an_old_env_in(tmp_path):
    directory = tmp_path / "secrets"
    first = make_secrets(directory)
    (directory / "api_token").unlink()
    again = make_secrets(directory, environ={"API_TOKEN": "moved-from-an-old-env-file", "ADMIN_TOKEN": "ignored"})
    assert again["api_token"] == "moved-from-an-old-env-file"  # a missing file takes its variable
    assert {k: v for k, v in again.items() if k != "api_token"} == {k: v for k, v in first.items() if k != "api_token"}


def test_make_secrets_refuses_a_short_value_from_a_generic_variable(tmp_path):
    """Issue 48 item 12: API_TOKEN, ADMIN_TOKEN, ... are generic names a shell may hold for
    something else; one shorter than 16 characters is refused, naming it, not written weak."""
    directory = tmp_path / "secrets"
    proc = subprocess.run(["bash", str(REPO / "docker" / "make-secrets.sh"), str(directory)], capture_output=True,
                          text=True, timeout=30, env={"PATH": "/usr/bin:/bin", "API_TOKEN": "x"})
    assert proc.returncode == 1 and "$API_TOKEN" in proc.stderr and "16 characters" in proc.stderr, proc.stderr
    assert not (directory / "api_token").exists()


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin", **env})


def test_nats_entry_point_refuses_a_missing_password_file_and_hands_the_rest_to_nats_server(tmp_path):
    directory = tmp_path / "secrets"
    values = make_secrets(directory)
    fake = tmp_path / "bin" / "nats-server"  # prints what nats-server would get
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "args=$*"\necho "rollout=$NATS_ROLLOUT_PASSWORD trainer=$NATS_TRAINER_PASSWORD sys=$NATS_SYS_PASSWORD"\n')
    fake.chmod(0o755)
    env = {"NATS_SECRETS_DIR": str(directory), "PATH": f"{fake.parent}:/usr/bin:/bin"}
    entry = str(REPO / "docker" / "nats" / "entrypoint.sh")
    ok = _run(["sh", entry, "-c", "/etc/nats/nats.conf"], env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == ["args=-c /etc/nats/nats.conf",
                                      f"rollout={values['nats_rollout_password']} trainer={values['nats_trainer_password']} "
                                      f"sys={values['nats_sys_password']}"]
    os.chmod(directory, 0o700)
    (directory / "nats_sys_password").unlink()
    refused = _run(["sh", entry, "-c", "/etc/nats/nats.conf"], env)
    assert refused.returncode == 2 and "nats_sys_password" in refused.stderr and "args=" not in refused.stdout


def test_engine_entry_point_reads_the_key_file_and_refuses_an_unreadable_one(tmp_path):
    (tmp_path / "key").write_text("engine-key-from-a-file")
    base = {"ENGINE_MODEL_PATH": "/models/m", "ENGINE_SLOT_DIR": str(tmp_path / "slots"), "ENGINE_DRY_RUN": "1",
            "ENGINE_ADDR_FILE": str(tmp_path / "addr"), "TMPDIR": str(tmp_path)}
    engine = str(REPO / "docker" / "sglang" / "engine.sh")
    ok = _run(["bash", engine], {**base, "ENGINE_API_KEY_FILE": str(tmp_path / "key")})
    assert ok.returncode == 0, ok.stderr
    argv = ok.stdout.split("\n")
    config = argv[argv.index("--config") + 1]
    assert open(config).read().strip() == '{"api-key": "engine-key-from-a-file"}'
    assert "engine-key-from-a-file" not in ok.stdout + ok.stderr
    refused = _run(["bash", engine], {**base, "ENGINE_API_KEY_FILE": str(tmp_path / "missing")})
    assert refused.returncode == 2 and "ENGINE_API_KEY_FILE" in refused.stderr


def test_engine_entry_point_puts_the_weight_group_on_the_interface_of_its_host(tmp_path):
    """Issue 48 item 3: with ENGINE_HOST a node address, NCCL's and gloo's sockets are told its
    interface (``lo`` here for 127.0.0.1); an operator's own NCCL_SOCKET_IFNAME stays."""
    (tmp_path / "key").write_text("engine-key-from-a-file")
    venv_bin = str(Path(sys.executable).parent)  # a python3 with psutil, as the SGLang image has
    base = {"ENGINE_MODEL_PATH": "/models/m", "ENGINE_SLOT_DIR": str(tmp_path / "slots"), "ENGINE_DRY_RUN": "1",
            "ENGINE_ADDR_FILE": str(tmp_path / "addr"), "TMPDIR": str(tmp_path), "ENGINE_HOST": "127.0.0.1",
            "ENGINE_API_KEY_FILE": str(tmp_path / "key"), "PATH": f"{venv_bin}:/usr/bin:/bin"}
    engine = str(REPO / "docker" / "sglang" / "engine.sh")
    chosen = subprocess.run(["bash", engine], capture_output=True, text=True, timeout=30, env=base)
    assert chosen.returncode == 0 and "(weight-group interface: lo)" in chosen.stderr, chosen.stderr
    kept = subprocess.run(["bash", engine], capture_output=True, text=True, timeout=30,
                          env={**base, "NCCL_SOCKET_IFNAME": "ib0"})
    assert kept.returncode == 0 and "(weight-group interface: ib0)" in kept.stderr, kept.stderr
