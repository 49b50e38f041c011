"""LoRA adapters on the policy (``actor.lora_rank``, trainer_daemon/policy/lora.py): only the adapters
train, on one rank and FSDP2 over two alike; the merged weights the engines get and the peft
adapter the export writes give the trained model's logits; checkpoints hold the adapters and
their optimiser state alone and resume exactly; bad settings are refused naming them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncrl.config import ConfigError, load_config
from asyncrl.launch import free_port
from asyncrl.models import load_model
from trainer_daemon.policy.lora import LORA_A, LORA_B, adapter_weights, merged_weights
from trainer_daemon.policy.model import build_optimizer, build_policy, engine_weights
from trainer_daemon.state.checkpoint import ModelOptimState
from trainer_daemon.state.export import export_hf

ROOT = str(Path(__file__).resolve().parents[2])
WORKER = str(Path(__file__).with_name("step_worker.py"))
LORA = (4, 8.0, "all-linear")
SCALING = 8.0 / 4
TOKENS = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 12, 64, 8]])


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """DCP and the state-dict helpers want a (one-rank) process group."""
    created = not torch.distributed.is_initialized()
    if created:  # (not through os.environ: the step workers inherit it)
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if created:
        torch.distributed.destroy_process_group()


def lora_policy(lora=LORA):
    return build_policy("builtin:tiny", 0, torch.device("cpu"), 1, lora=lora)


def trained(model):
    """``model`` after adapters that are not zero: every lora_B filled (they start at zero)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if LORA_B in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def logits(model):
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def test_only_the_adapters_train_and_the_model_starts_as_the_base():
    model = lora_policy()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(LORA_A in n or LORA_B in n for n in trainable)
    assert not any("lm_head" in n or "embed" in n for n in trainable)
    torch.testing.assert_close(logits(model), logits(load_model("builtin:tiny", dtype="float32", seed=0)), rtol=0, atol=0)
    again = lora_policy()  # the adapters' initialisation is seeded: the same on every rank and every start
    for (n, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    opt = build_optimizer(model, load_config(environ={}).actor.optim)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(p.numel() for n, p in model.named_parameters()
                                                                                 if n in trainable)


def test_the_merged_weights_are_the_adapted_model():
    """What the engines load (``engine_weights`` with the scaling): the base model's names, each
    adapted weight merged; a plain model loading them gives the adapted model's logits."""
    model = trained(lora_policy())
    full = {n: t.detach().clone() for n, t in model.state_dict().items()}
    base = load_model("builtin:tiny", dtype="float32", seed=0)
    merged = engine_weights(full, bool(base.config.tie_word_embeddings), lora_scaling=SCALING)
    assert set(merged) == {n for n in base.state_dict() if not (base.config.tie_word_embeddings and n == "lm_head.weight")}
    base.load_state_dict(merged, strict=False)
    torch.testing.assert_close(logits(base), logits(model), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(base), logits(load_model("builtin:tiny", dtype="float32", seed=0)))
    plain = {"x.weight": torch.ones(2)}
    assert merged_weights(plain, SCALING)["x.weight"] is plain["x.weight"]  # no adapters: untouched


def test_the_export_holds_the_merged_model_and_a_peft_adapter(tmp_path):
    from peft import PeftModel

    model = trained(lora_policy())
    full = {n: t.detach().clone() for n, t in model.state_dict().items()}
    cfg = load_config(overrides=["actor.lora_rank=4", "actor.lora_alpha=8", "model.path=builtin:tiny"], environ={})
    export_hf(tmp_path / "export", full, model.config, cfg.actor, cfg.model)
    merged = load_model(str(tmp_path / "export"), dtype="float32")
    torch.testing.assert_close(logits(merged), logits(model), rtol=1e-5, atol=1e-5)
    doc = json.loads((tmp_path / "export" / "adapter" / "adapter_config.json").read_text())
    assert doc["r"] == 4 and doc["lora_alpha"] == 8 and doc["peft_type"] == "LORA" and "q_proj" in doc["target_modules"]
    peft_model = PeftModel.from_pretrained(load_model("builtin:tiny", dtype="float32", seed=0), str(tmp_path / "export" / "adapter"))
    torch.testing.assert_close(logits(peft_model), logits(model), rtol=1e-5, atol=1e-5)
    assert len(adapter_weights(full)) == sum(LORA_A in n or LORA_B in n for n in full)


def test_a_checkpoint_holds_the_adapters_alone_and_resumes_exactly(tmp_path):
    cfg = load_config(overrides=["actor.lora_rank=4"], environ={})
    model = lora_policy()
    opt = build_optimizer(model, cfg.actor.optim)
    model(input_ids=TOKENS).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    dcp.save({"app": ModelOptimState(model, opt)}, checkpoint_id=str(tmp_path / "ck"))
    saved = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata
    model_keys = {k.split("app.model.", 1)[1] for k in saved if k.startswith("app.model.")}
    assert model_keys and all(LORA_A in k or LORA_B in k for k in model_keys), sorted(model_keys)[:5]
    again = lora_policy()
    opt2 = build_optimizer(again, cfg.actor.optim)
    dcp.load({"app": ModelOptimState(again, opt2)}, checkpoint_id=str(tmp_path / "ck"))
    for (n, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    for k, s in opt.state_dict()["state"].items():
        assert torch.equal(s["exp_avg_sq"], opt2.state_dict()["state"][k]["exp_avg_sq"])
    fewer = lora_policy((4, 8.0, ["q_proj"]))  # a checkpoint of fewer adapters cannot resume a run of more
    dcp.save({"app": ModelOptimState(fewer, build_optimizer(fewer, cfg.actor.optim))}, checkpoint_id=str(tmp_path / "q"))
    more = lora_policy()
    with pytest.raises(dcp.api.CheckpointException) as err:
        dcp.load({"app": ModelOptimState(more, build_optimizer(more, cfg.actor.optim))}, checkpoint_id=str(tmp_path / "q"))
    assert re.search(r"Missing key in checkpoint state_dict: \S+k_proj.lora_A", str(err.value.failures)), err.value.failures


def test_two_ranks_train_the_adapters_as_one_does(tmp_path):
    """FSDP2 over two ranks (dummy micro-batches on the second) gives one rank's update."""
    variant = "actor.lora_rank=4,actor.lora_alpha=8"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"{nproc}.pt"
        argv = ([sys.executable, WORKER] if nproc == 1 else
                [sys.executable, "-m", "trainer_daemon.torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(free_port()), WORKER])
        res = subprocess.run([*argv, str(out), variant], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[nproc] = torch.load(out, weights_only=False)[0]
    one, two = runs[1]["weights"], runs[2]["weights"]
    for name, w in one.items():
        torch.testing.assert_close(two[name], w, rtol=0, atol=2e-6, msg=name)
    start = lora_policy().state_dict()
    frozen = [n for n in one if LORA_A not in n and LORA_B not in n]
    assert all(torch.equal(one[n], start[n]) for n in frozen), "a frozen base weight moved"
    assert max((one[n] - start[n]).abs().max().item() for n in one if LORA_B in n) > 1e-4, "the adapters did not train"


def test_bad_lora_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"actor.target_modules=\['nope'\]"):
        lora_policy((4, 8.0, ["nope"]))
    with pytest.raises(ConfigError, match="actor.lora_rank=4 needs sync.staging=auto or state_dict"):
        load_config(overrides=["actor.lora_rank=4", "sync.lora_weights=merged", "sync.staging=buckets"], environ={})
    assert load_config(overrides=["actor.lora_rank=4", "sync.staging=buckets"], environ={}).syncs_adapters  # staging unused
    with pytest.raises(ConfigError, match="sync.lora_weights=adapter needs sync.pause_policy=abort with partial rollout"):
        load_config(overrides=["actor.lora_rank=4", "async_training.partial_rollout=true", "async_training.staleness_threshold=1",
                               "sync.pause_policy=in_place"], environ={})
    with pytest.raises(ConfigError, match="lora_rank"):
        load_config(overrides=["actor.lora_rank=-1"], environ={})


def test_adapter_syncs_need_the_sync_agent():
    """Without the agent the rollout service cannot learn which adapter to ask for: a trainer
    driving engines itself with adapter syncs is refused, naming both ways out."""
    from trainer_daemon.sync import build_publisher

    cfg = load_config(overrides=["actor.lora_rank=4", "engines.urls=[\"http://127.0.0.1:9\"]"], environ={})
    with pytest.raises(ValueError, match=r"sync.lora_weights=adapter needs the sync agent \(sync.url\).*sync.lora_weights=merged"):
        build_publisher(cfg)
    merged = load_config(overrides=["actor.lora_rank=4", "engines.urls=[\"http://127.0.0.1:9\"]", "sync.lora_weights=merged"],
                         environ={})
    assert type(build_publisher(merged)).__name__ == "DirectEnginePublisher"
