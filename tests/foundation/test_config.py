"""The run config: precedence, parsing, errors that name the field, derived numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.config import ConfigError, RunConfig, load_config
from asyncrl.config.loader import parse_value


def test_defaults_validate_and_every_field_is_documented():
    cfg = load_config(environ={})
    assert isinstance(cfg, RunConfig)

    def walk(model_cls, prefix=""):
        for name, info in model_cls.model_fields.items():
            assert info.description, f"{prefix}{name} has no docstring"
            ann = info.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")

    walk(RunConfig)


def test_precedence_file_env_cli(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("[rollout]\nn = 2\nresponse_length = 100\n[actor]\nppo_mini_batch_size = 3\n")
    env = {"ASYNCRL_ROLLOUT__N": "5", "ASYNCRL_ACTOR__PPO_MINI_BATCH_SIZE": "7"}
    cfg = load_config(f, ["rollout.n=9"], environ=env)
    assert cfg.rollout.n == 9  # cli beats env beats file
    assert cfg.actor.ppo_mini_batch_size == 7  # env beats file
    assert cfg.rollout.response_length == 100  # file beats default
    assert cfg.rollout.sampling.temperature == 1.0  # default kept inside a partly given section


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "rollout:\n  n: 6\nasync_training:\n  staleness_threshold: 0.25\n"),
    (".json", json.dumps({"rollout": {"n": 6}, "async_training": {"staleness_threshold": 0.25}})),
    (".toml", "[rollout]\nn = 6\n[async_training]\nstaleness_threshold = 0.25\n"),
])
def test_file_formats(tmp_path: Path, suffix: str, text: str):
    f = tmp_path / f"c{suffix}"
    f.write_text(text)
    cfg = load_config(f, environ={})
    assert (cfg.rollout.n, cfg.async_training.staleness_threshold) == (6, 0.25)


def test_nested_env_and_list_values():
    env = {"ASYNCRL_ROLLOUT__SAMPLING__TEMPERATURE": "0.7", "ASYNCRL_ENGINES__URLS": '["http://a:1/", "http://b:2"]',
           "ASYNCRL_CACHE_DIR": "/not/a/config/key"}
    cfg = load_config(environ=env)
    assert cfg.rollout.sampling.temperature == 0.7
    assert cfg.engines.urls == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize("override,field,fragment", [
    ("rollout.n=0", "rollout.n", "allowed range [1, 1024]"),
    ("rollout.sampling.top_p=1.5", "rollout.sampling.top_p", "allowed range (0.0, 1.0]"),
    ("async_training.staleness_threshold=-1", "async_training.staleness_threshold", "allowed range [0.0, 100.0]"),
    ("actor.clip_ratio_c=0.5", "actor.clip_ratio_c", "greater than 1"),
    ("rollout.n=abc", "rollout.n", "valid integer"),
    ("engines.urls=[\"ftp://x\"]", "engines.urls", "http://"),
    ("run.id=Bad!", "run.id", "pattern"),
    ("rollout.nonexistent=1", "rollout.nonexistent", "Extra inputs"),
])
def test_invalid_values_name_the_field_and_range(override: str, field: str, fragment: str):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override], environ={})
    msg = str(err.value)
    assert f"{field}:" in msg and fragment in msg and "argument" in msg


def test_env_error_names_the_variable():
    with pytest.raises(ConfigError, match="ASYNCRL_ROLLOUT__N"):
        load_config(environ={"ASYNCRL_ROLLOUT__N": "-2"})


def test_bad_files_are_clear_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad, environ={})
    odd = tmp_path / "c.ini"
    odd.write_text("x")
    with pytest.raises(ConfigError, match="unknown format"):
        load_config(odd, environ={})
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(overrides=["rollout.n"], environ={})


def test_parse_value():
    assert parse_value("null") is None
    assert parse_value("[1, 2]") == [1, 2]
    assert parse_value("{a: 1}") == {"a": 1}
    assert parse_value("3") == "3"  # pydantic converts by the field's type


@given(
    mini=st.integers(1, 512), req=st.integers(1, 16), trig=st.integers(1, 16),
    stale=st.floats(0, 3, allow_nan=False), n=st.integers(1, 64), engines=st.integers(1, 8),
)
def test_derived_numbers_follow_verl(mini, req, trig, stale, n, engines):
    cfg = load_config(overrides=[
        f"actor.ppo_mini_batch_size={mini}", f"async_training.require_batches={req}",
        f"async_training.trigger_parameter_sync_step={trig}", f"async_training.staleness_threshold={stale!r}",
        f"rollout.n={n}", f"engines.num_local={engines}", "rollout.total_rollout_steps=100000",
    ], environ={})
    d = cfg.derived
    assert d.required_samples == mini * req
    assert d.required_trajectories == mini * req * n
    assert d.max_required_samples == math.floor(mini * req * trig * (1 + stale) + 1e-9)
    assert d.max_queue_size == d.max_required_samples
    assert d.max_concurrent_samples == 16 * engines
    assert d.total_syncs == 100000 // (mini * req * trig)


def test_seed_example_from_verl_docs():
    # verl's worked example: mini 256, require_batches 4, staleness 3, trigger 2 → 1024 / 8192
    cfg = load_config(overrides=["actor.ppo_mini_batch_size=256", "async_training.require_batches=4",
                                 "async_training.staleness_threshold=3", "async_training.trigger_parameter_sync_step=2"], environ={})
    assert (cfg.derived.required_samples, cfg.derived.max_required_samples, cfg.derived.max_queue_size) == (1024, 8192, 8192)


def test_config_show_cli(tmp_path: Path):
    exe = [sys.executable, "-m", "launcher", "config", "show"]
    ok = subprocess.run([*exe, "rollout.n=8", "security.admin_token=s3cret", "--json"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["rollout"]["n"] == 8 and doc["derived"]["required_trajectories"] == 8 * doc["derived"]["required_samples"]
    assert "s3cret" not in ok.stdout
    bad = subprocess.run([*exe, "rollout.n=0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "rollout.n" in bad.stderr and "Traceback" not in bad.stderr


def test_config_reference_doc_is_current():
    from asyncrl.config.reference import render

    committed = (Path(__file__).resolve().parents[2] / "docs" / "config_reference.md").read_text()
    assert committed == render(), "docs/config_reference.md is stale: run python -m asyncrl.config.reference > docs/config_reference.md"


def test_secret_reads_optional_secret_fields():
    from asyncrl.config import secret

    cfg = load_config(overrides=["security.admin_token=abc", "security.api_token="], environ={})
    assert secret(cfg.security.admin_token) == "abc" and "abc" not in repr(cfg.security)
    assert secret(cfg.security.api_token) is None and secret(cfg.security.sync_token) is None  # empty, unset


def test_a_secret_can_come_from_a_file_named_by_its_variable(tmp_path):
    """``ASYNCRL_SECTION__KEY_FILE`` (Docker/Kubernetes secrets): the token never sits in the
    environment (issue 30 item 8); a file that cannot be read is a config error naming it."""
    from asyncrl.config import ConfigError, secret

    (tmp_path / "admin").write_text("admin-token-from-a-file-0123\n")
    cfg = load_config(environ={"ASYNCRL_SECURITY__ADMIN_TOKEN_FILE": str(tmp_path / "admin"),
                               "ASYNCRL_ENGINES__API_KEY_FILE": str(tmp_path / "admin")})
    assert secret(cfg.security.admin_token) == "admin-token-from-a-file-0123" == secret(cfg.engines.api_key)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(environ={"ASYNCRL_SECURITY__SYNC_TOKEN_FILE": str(tmp_path / "missing")})
