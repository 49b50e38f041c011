"""local_engine's command line is derived from its settings model: settings → argv → parse gives
the same settings; a bad value is refused naming the field and its flag; ``asyncrl up``'s
engines get the run config's ``engines.local`` section through the same function."""

from __future__ import annotations

import argparse

import pytest

from asyncrl.config import load_config
from local_engine.flags import leaves
from local_engine.settings import EngineSettings, SettingsError, build_parser


def every_field_changed() -> EngineSettings:
    return EngineSettings(
        model="/models/x", host="0.0.0.0", port=31234, port_slots=4, slot_dir="/tmp/slots", addr_file="/tmp/addr", dtype="bfloat16", seed=7, max_model_len=1024,
        api_key="key-1", admin_api_key="key-2", weight_version="v3", served_model_name="-starts-with-dash",
        log_level="debug", log_json=True, max_batch_size=5, device="cuda", torch_threads=0,
        weight_sync_timeout_s=12.5, pause_drain_timeout_s=1e-3, sglang_compat="0.5.18", tp_size=2, dp_size=3,
        pp_size=2, enable_dp_attention=True, disable_radix_cache=True, disable_overlap_schedule=True, enable_deterministic_inference=True, health_generation=False, health_check_timeout_s=0.1,
        enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj", "v_proj"], lora_paths=["a=/adapters/a", "/adapters/b"],
        max_loaded_loras=3, max_loras_per_batch=2, sampling_mask_max_tokens=77, sglang_fatal_errors=True,
        enable_return_routed_experts=True,
        timing={"enabled": True, "decode_ms": 0.0, "prefill_ms_per_token": 1 / 3, "length_median": 16,
                "length_sigma": 1.5, "length_max": 77},
    )


def test_every_field_is_a_flag_and_survives_the_round_trip():
    s = every_field_changed()
    assert all(getattr(s, p[0]) != EngineSettings.model_fields[p[0]].get_default(call_default_factory=True)
               for p, _ in leaves(EngineSettings) if len(p) == 1)  # the fixture really changes everything
    argv = s.to_argv()
    assert EngineSettings.from_argv(argv, environ=s.secret_env()) == s
    assert not any("key-1" in a or "key-2" in a for a in argv)  # keys travel in the environment
    assert "--timing-mode" in argv and "--no-health-generation" in argv and "--served-model-name=-starts-with-dash" in argv
    assert argv[argv.index("--max-batch-size") + 1] == "5"
    assert argv[argv.index("--lora-target-modules") + 1:argv.index("--lora-target-modules") + 3] == ["q_proj", "v_proj"]
    assert EngineSettings().to_argv() == [] and EngineSettings.from_argv([], environ={}) == EngineSettings()


def test_historical_flag_spellings_still_parse():
    s = EngineSettings.from_argv(["--model", "builtin:tiny", "--port", "0", "--max-batch-size", "4", "--timing-mode",
                                  "--timing-decode-ms", "20", "--sglang-compat", "0.5.21", "--enable-dp-attention",
                                  "--weight-sync-timeout-s", "15", "--torch-threads", "2", "--log-level", "warning"],
                                 environ={})
    assert (s.max_batch_size, s.timing.enabled, s.timing.decode_ms, s.compat.version, s.enable_dp_attention,
            s.weight_sync_timeout_s, s.torch_threads, s.log_level) == (4, True, 20.0, "0.5.21", True, 15.0, 2, "warning")


@pytest.mark.parametrize(("argv", "field", "flag"), [
    (["--max-batch-size", "0"], "max_batch_size", "--max-batch-size"),
    (["--timing-decode-ms", "fast"], "timing.decode_ms", "--timing-decode-ms"),
    (["--dtype", "float8"], "dtype", "--dtype"),
    (["--sglang-compat", "0.4.0"], "sglang_compat", "--sglang-compat"),
])
def test_a_bad_value_is_refused_naming_the_field(argv, field, flag):
    with pytest.raises(SettingsError) as exc:
        EngineSettings.from_argv(argv, environ={})
    assert f"{field} ({flag}):" in str(exc.value) and repr(argv[1]) in str(exc.value)


def test_environment_fallbacks_and_flags_beat_them():
    env = {"LOCAL_ENGINE_API_KEY": "k", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
           "SGLANG_HEALTH_CHECK_TIMEOUT": "3"}
    s = EngineSettings.from_argv([], environ=env)
    assert (s.api_key, s.health_generation, s.health_check_timeout_s) == ("k", False, 3.0)
    s = EngineSettings.from_argv(["--api-key", "flag", "--health-generation"], environ=env)
    assert (s.api_key, s.health_generation) == ("flag", True)


def test_keys_from_secret_files(tmp_path):
    """compose's engine-cpu: the key is a Docker secret, in no environment; an unreadable file is
    refused naming the variable."""
    (tmp_path / "key").write_text("from-file\n")
    s = EngineSettings.from_argv([], environ={"LOCAL_ENGINE_API_KEY_FILE": str(tmp_path / "key")})
    assert s.api_key == "from-file" and s.admin_api_key is None
    s = EngineSettings.from_argv([], environ={"LOCAL_ENGINE_API_KEY": "env", "LOCAL_ENGINE_API_KEY_FILE": str(tmp_path / "key")})
    assert s.api_key == "env"
    with pytest.raises(SettingsError) as exc:
        EngineSettings.from_argv([], environ={"LOCAL_ENGINE_ADMIN_API_KEY_FILE": str(tmp_path / "missing")})
    assert "LOCAL_ENGINE_ADMIN_API_KEY_FILE" in str(exc.value) and "missing" in str(exc.value)


def test_unknown_flags_exit_like_argparse():
    with pytest.raises(SystemExit) as exc:
        EngineSettings.from_argv(["--timing-mode-x"], environ={})
    assert exc.value.code == 2
    assert isinstance(build_parser(), argparse.ArgumentParser)


def test_up_builds_each_engine_from_the_run_config():
    cfg = load_config(overrides=["model.path=builtin:tiny", "model.seed=3", "model.max_model_len=512",
                                 "engines.local.max_batch_size=9", "engines.local.timing.enabled=true",
                                 "engines.local.timing.length_median=16", "run.log_level=DEBUG", "run.log_json=true",
                                 "engines.api_key=not-for-local-engines"], environ={})
    s = EngineSettings.for_run(cfg, 4321)
    assert (s.port, s.host, s.seed, s.max_model_len, s.max_batch_size, s.log_level, s.log_json) == \
        (4321, "127.0.0.1", 3, 512, 9, "debug", True)
    assert s.timing == cfg.engines.local.timing and s.api_key is None and s.secret_env() == {}
    assert EngineSettings.from_argv(s.to_argv(), environ={}) == s


def test_run_config_refuses_a_bad_local_engine_value_naming_the_field():
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"engines\.local\.timing\.length_max"):
        load_config(overrides=["engines.local.timing.length_max=0"], environ={})
