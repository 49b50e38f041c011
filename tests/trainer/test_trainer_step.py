"""The step function across world sizes and loss options (``step_worker.py`` in subprocesses).

- 2 ranks, one of them running dummy micro-batches, give the same SGD update as 1 rank (the
  global normalisers and ``dp_size`` make the split invisible), for three aggregation modes,
  one with token-budget micro-batches.
- Packed rows with the chunked log-prob head give the right-padded path's update, for every
  objective and aggregation mode.
- The optional paths run and report their metrics: KL to a frozen reference, proximal
  log-probs (decoupled PPO), entropy bonus, bf16 mixed precision, activation checkpointing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.launch import free_port

WORKER = str(Path(__file__).with_name("step_worker.py"))
ROOT = str(Path(__file__).resolve().parents[2])
RUN_S = 240


def _run(out: Path, nproc: int, *overrides: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if nproc == 1:
        argv = [sys.executable, WORKER, str(out), *overrides]
    else:
        argv = [sys.executable, "-m", "trainer_daemon.torchrun", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), WORKER, str(out), *overrides]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=RUN_S, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return torch.load(out, weights_only=False)


MODES = ["actor.loss_agg_mode=token-mean", "actor.loss_agg_mode=seq-mean-token-mean",
         # token-budget micro-batches (2-3 packed trajectories each) and dummies on the second rank
         "actor.loss_agg_mode=seq-mean-token-sum,actor.use_dynamic_bsz=true,model.max_model_len=32,"
         "actor.ppo_max_token_len_per_gpu=32,actor.log_prob_chunk_tokens=3"]
# Packed rows (the default) against right-padded rows, same micro-batches of 3 trajectories, for
# every objective and aggregation of docs/algorithms.md, with KL, entropy, proximal log-probs
# and temperatures != 1 (the batch has them): the same SGD update (issue 31, item 6).
PATHS = [
    "actor.loss_agg_mode=token-mean",
    "actor.loss_agg_mode=token-mean,actor.attn_implementation=eager",  # the additive float mask
    "actor.loss_agg_mode=seq-mean-token-sum",
    "actor.loss_agg_mode=seq-mean-token-sum-norm",
    "actor.loss_agg_mode=seq-mean-token-mean,actor.use_kl_loss=true,actor.kl_loss_coef=0.1,actor.entropy_coeff=0.01,"
    "async_training.compute_prox_log_prob=true",
    "actor.loss_mode=gspo,actor.loss_agg_mode=seq-mean-token-mean,async_training.compute_prox_log_prob=true,"
    "actor.rollout_is_level=sequence,actor.calculate_entropy=true",
    "actor.loss_mode=cispo,async_training.compute_prox_log_prob=true,actor.tis_imp_ratio_cap=null,actor.rollout_rs=token,"
    "actor.rollout_rs_threshold=1.5,actor.rollout_rs_threshold_lower=0.5",
]
OPTIONAL = ",".join(["actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "actor.entropy_coeff=0.01",
                     "async_training.compute_prox_log_prob=true", "trainer.mixed_precision=bf16",
                     "actor.activation_checkpointing=true", "actor.filter_zero_variance_groups=true"])
# the other objectives and corrections of docs/algorithms.md, each through a whole step (proximal
# log-probs, so the rollout log-probs enter through the correction weight)
OBJECTIVES = [",".join(["actor.loss_mode=gspo", "actor.clip_ratio_low=0.0003", "actor.clip_ratio_high=0.0004",
                        "actor.loss_agg_mode=seq-mean-token-mean", "actor.adv_estimator=rloo",
                        "async_training.compute_prox_log_prob=true", "actor.rollout_is_level=sequence"]),
              ",".join(["actor.loss_mode=cispo", "async_training.compute_prox_log_prob=true", "actor.tis_imp_ratio_cap=null",
                        "actor.rollout_rs=token", "actor.rollout_rs_threshold=1.5", "actor.rollout_rs_threshold_lower=0.5"])]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("step")
    micro3 = "actor.ppo_micro_batch_size_per_gpu=3,actor.log_prob_chunk_tokens=2"
    paths = [f"{v},{micro3},actor.use_remove_padding={packed}" for v in PATHS for packed in ("true", "false")]
    compiled = [micro3, f"{micro3},actor.use_torch_compile=true"]
    return {"one": _run(d / "one.pt", 1, *MODES, OPTIONAL, *OBJECTIVES, *paths, *compiled), "two": _run(d / "two.pt", 2, *MODES)}


def test_compiled_decoder_blocks_give_the_same_update(results):
    """``actor.use_torch_compile`` (every decoder block compiled, dynamic shapes)."""
    eager, compiled = results["one"][-2], results["one"][-1]
    for name, w in eager["weights"].items():
        torch.testing.assert_close(compiled["weights"][name], w, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("variant", range(len(PATHS)), ids=[p.split(",")[0] for p in PATHS])
def test_packed_rows_and_chunked_log_probs_give_the_padded_paths_update(results, variant):
    base = len(MODES) + 1 + len(OBJECTIVES) + 2 * variant
    packed, padded = results["one"][base], results["one"][base + 1]
    for name, w in padded["weights"].items():
        torch.testing.assert_close(packed["weights"][name], w, rtol=0, atol=1e-5, msg=name)
    for key, value in padded["metrics"].items():
        if key.startswith("actor/") and key != "actor/lr":
            assert packed["metrics"][key] == pytest.approx(value, abs=1e-5, rel=1e-5), key


@pytest.mark.parametrize("variant", range(len(MODES)), ids=MODES)
def test_two_ranks_with_dummy_micro_batches_match_one_rank(results, variant):
    from asyncrl.models import load_model

    one, two = results["one"][variant], results["two"][variant]
    for name, w1 in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w1, rtol=0, atol=2e-6, msg=name)
    base = load_model("builtin:tiny", seed=0).state_dict()
    moved = max((one["weights"][n] - base[n]).abs().max().item() for n in base)
    assert moved > 1e-4, "the step did not change the weights"
    assert one["metrics"]["actor/pg_loss"] == pytest.approx(two["metrics"]["actor/pg_loss"], abs=1e-6)


def test_optional_loss_paths_run_and_report(results):
    res = results["one"][len(MODES)]
    m = res["metrics"]
    for key in ("actor/kl_loss", "actor/entropy", "actor/is_weight_mean", "actor/pg_loss", "actor/grad_norm"):
        assert key in m and m[key] == m[key], key  # present and not NaN
    assert m["trainer/zero_variance_filtered"] == 2 and m["timing_s/old_log_prob"] > 0 and m["timing_s/ref"] > 0
    assert all(torch.isfinite(t).all() for t in res["weights"].values())


@pytest.mark.parametrize("variant", range(len(OBJECTIVES)), ids=["gspo-rloo-seq-tis", "cispo-icepop"])
def test_other_objectives_and_corrections_train(results, variant):
    from asyncrl.models import load_model

    res = results["one"][len(MODES) + 1 + variant]
    m = res["metrics"]
    assert all(torch.isfinite(t).all() for t in res["weights"].values())
    base = load_model("builtin:tiny", seed=0).state_dict()
    assert max((res["weights"][n] - base[n]).abs().max().item() for n in base) > 1e-6, "the step did not change the weights"
    assert m["actor/pg_loss"] == m["actor/pg_loss"] and "actor/is_weight_mean" in m and "actor/behav_kl" in m
    if variant == 1:
        assert 0.0 <= m["actor/rs_masked_frac"] <= 1.0
