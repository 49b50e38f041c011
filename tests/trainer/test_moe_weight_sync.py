"""A mixture-of-experts model's weight sync in the checkpoint's names (issue 53): transformers
fuses the experts in memory (``experts.gate_up_proj``), SGLang's ``load_weights`` takes one
matrix per expert (``experts.{e}.gate_proj.weight``) and skips a fused name silently. The
trainer's buckets (device path) and host path both carry what ``save_pretrained`` writes, a real
local_engine serving ``builtin:tiny-moe`` loads them into its fused tensors exactly (its checksum
equals the trainer's), refuses the fused names with a reason and keeps its weights, and an export
loads back as the same model."""

from __future__ import annotations

import pytest
import torch
from transformers.core_model_loading import revert_weight_conversion

from asyncrl.engine_client import EngineClient
from asyncrl.models import load_model
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.weight_sync.checksum import canonical, weights_checksum
from tests.helpers.processes import SEED, start_engine
from tests.trainer.test_weight_staging import unpacked
from trainer_daemon.policy.model import engine_weights, full_state_dict
from trainer_daemon.sync.direct import DirectEnginePublisher
from trainer_daemon.sync.staging import WeightStager, engine_layout

TIMEOUT_S = 60.0
FUSED = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def trainer_model():
    return load_model("builtin:tiny-moe", seed=SEED + 1)  # not the engine's weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_both_staging_paths_carry_what_save_pretrained_writes(trainer_model, dtype):
    expected = revert_weight_conversion(trainer_model, engine_weights(full_state_dict(trainer_model), False, dtype))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in expected and FUSED not in expected
    staged = unpacked(WeightStager(trainer_model, tied=False, dtype=dtype, bucket_bytes=2**15, device="cpu", is_sender=True)
                      .capture(trainer_model))
    host = engine_layout(trainer_model, False).to_checkpoint(engine_weights(full_state_dict(trainer_model), False, dtype))
    for got in (staged, host):
        assert sorted(got) == sorted(expected)
        assert all(got[k].dtype == dtype and torch.equal(got[k], expected[k]) for k in expected)


def test_a_dense_models_names_are_unchanged():
    model = load_model("builtin:tiny")
    assert engine_layout(model, True).identity


async def test_local_engine_loads_a_moe_sync_in_checkpoint_names_and_refuses_fused_ones(tmp_path, trainer_model):
    with start_engine(tmp_path, model="builtin:tiny-moe", name="moe-engine") as engine:
        async with EngineClient(engine.url, control_timeout_s=TIMEOUT_S) as client:
            before = (await client.weights_checksum())["checksum"]
            expected = weights_checksum(canonical(trainer_model.state_dict()))
            assert before != expected
            pub = DirectEnginePublisher([client], master_address="127.0.0.1", bucket_bytes=2**15, group_timeout_s=TIMEOUT_S,
                                        broadcast_timeout_s=TIMEOUT_S, control_timeout_s=TIMEOUT_S)
            try:
                fused = engine_weights(full_state_dict(trainer_model), False, torch.float32)  # the in-memory names
                with pytest.raises(WeightSyncError, match="fused in-memory names.*experts.0.gate_proj.weight"):
                    await pub.publish(1, {FUSED: fused[FUSED]})
                assert (await client.weights_checksum())["checksum"] == before  # nothing of a refused bucket applied

                await pub.publish(2, engine_layout(trainer_model, False).to_checkpoint(fused))  # the host path
                got = await client.weights_checksum()
                assert (got["checksum"], got["weight_version"]) == (expected, "2")

                other = load_model("builtin:tiny-moe", seed=SEED + 2)
                staged = WeightStager(other, tied=False, dtype=torch.float32, bucket_bytes=2**15, device="cpu",
                                      is_sender=True).capture(other)  # the device path's buffers
                await pub.publish(3, staged)
                assert (await client.weights_checksum())["checksum"] == weights_checksum(canonical(other.state_dict()))
            finally:
                await pub.close()
            export_moe(tmp_path / "export", trainer_model)  # /update_weights_from_disk reads the checkpoint's names too
            await client.update_weights_from_disk(str(tmp_path / "export"), weight_version=4)
            assert (await client.weights_checksum())["checksum"] == expected


def export_moe(directory, model):
    from types import SimpleNamespace

    from trainer_daemon.state.export import export_hf

    actor = SimpleNamespace(lora_rank=0, lora_alpha=0)
    section = SimpleNamespace(tokenizer_path=None, path="builtin:tiny-moe")
    export_hf(directory, full_state_dict(model), model.config, actor, section, engine_layout(model, False))


def test_an_export_of_a_moe_model_loads_back_as_the_same_model(tmp_path, trainer_model):
    from safetensors.torch import load_file

    export_moe(tmp_path / "export", trainer_model)
    written = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert FUSED not in written and "model.layers.3.mlp.experts.7.up_proj.weight" in written
    back = load_model(str(tmp_path / "export"))
    assert weights_checksum(canonical(back.state_dict())) == weights_checksum(canonical(trainer_model.state_dict()))


async def test_a_moe_sync_is_refused_on_a_release_without_weight_update_sessions(tmp_path, trainer_model):
    """Issue 66 N5: before sglang 0.5.21 no session wraps a distributed update, so nothing runs
    the model's post-load processing (MoE runners that repack their expert weights would serve
    them unprocessed). A MoE sync to an engine emulating 0.5.20 is refused before any group
    forms, naming the engine, its release and the fix; the engine keeps its weights; a dense
    model's sync to the same release is not refused for it."""
    from asyncrl.sync_control.layout import moe_problems

    with start_engine(tmp_path, "--sglang-compat", "0.5.20", model="builtin:tiny-moe", name="moe-0.5.20") as engine:
        async with EngineClient(engine.url, control_timeout_s=TIMEOUT_S) as client:
            before = (await client.weights_checksum())["checksum"]
            pub = DirectEnginePublisher([client], master_address="127.0.0.1", bucket_bytes=2**15, group_timeout_s=TIMEOUT_S,
                                        broadcast_timeout_s=TIMEOUT_S, control_timeout_s=TIMEOUT_S)
            try:
                weights = engine_layout(trainer_model, False).to_checkpoint(
                    engine_weights(full_state_dict(trainer_model), False, torch.float32))
                with pytest.raises(WeightSyncError, match=f"engine {engine.url} runs sglang 0.5.20.*MoE.*>= 0.5.21"):
                    await pub.publish(1, weights)
            finally:
                await pub.close()
            assert (await client.weights_checksum())["checksum"] == before
    from asyncrl.sync_control.layout import EngineLayout

    old = [EngineLayout("e", version="0.5.20")]
    assert moe_problems(old, ["model.layers.0.mlp.down_proj.weight"]) == []
    assert moe_problems([EngineLayout("e", version="0.5.21")], ["model.layers.0.mlp.experts.3.up_proj.weight"]) == []
    assert moe_problems([EngineLayout("e")], ["model.layers.0.mlp.experts.3.up_proj.weight"]) == []  # unknown: not judged
