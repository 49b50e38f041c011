"""Trainer pieces without a cluster: batch layout, LR schedule, metric names, launcher argv,
checkpoint discovery, the step function on a one-rank world."""

from __future__ import annotations

import json
import random
import urllib.request

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.models import load_model
from asyncrl.wire import SamplingSpan
from tests.trainer.helpers import GOOD, make_group
from trainer_daemon.compute.batch import collate, dummy_micro_batch
from trainer_daemon.compute.step import StepSettings, TrainStep
from trainer_daemon.launch import torchrun_argv
from trainer_daemon.observe.metrics import MetricsHub, prometheus_name
from trainer_daemon.policy.distributed import DistContext
from trainer_daemon.policy.model import engine_weights, lr_factor
from trainer_daemon.state.checkpoint import MARKER, complete_checkpoints


def test_collate_aligns_logits_with_response_tokens():
    rng = random.Random(0)
    a = make_group(rng, "a", 2)[0]
    b = a.__class__(**{**{f: getattr(a, f) for f in a.__struct_fields__}, "id": "b", "token_ids": [5] + a.token_ids,
                       "prompt_length": a.prompt_length + 1, "temperature": 0.5})
    mb = collate([a, b], [0, 1], [1.5, -1.0], pad_id=0)
    first = a.prompt_length - 1
    assert mb.logits_to_keep == mb.input_ids.shape[1] - first
    for row in range(2):
        pos = mb.resp_index[row] + first  # absolute position of the logits scoring each response token
        assert torch.equal(mb.input_ids[row, pos + 1], mb.labels[row]) and mb.labels[row].tolist() == GOOD
    assert mb.advantages[0].tolist() == [1.5] * 4 and mb.temperature.tolist() == [[1.0] * 4, [0.5] * 4]


def test_the_behaviour_log_probs_are_the_truncated_distributions_where_recorded():
    """Issue 35: the micro-batch's ``rollout_logp`` (the behaviour policy of the importance
    ratios) is ``behaviour_logprobs`` where the trajectory has them, ``rollout_logprobs`` else,
    on the padded and the packed path alike."""
    from trainer_daemon.compute.packing import pack

    base = make_group(random.Random(4), "b", 2)[0]
    n = base.response_length
    behaviour = [lp + 0.25 * m if lp + 0.25 * m <= 0 else 0.0 for lp, m in zip(base.rollout_logprobs, base.loss_mask, strict=True)]
    spans = [SamplingSpan(start=0, temperature=0.7, top_k=20, behaviour_logprobs=True)]
    exact = base.__class__(**{**{f: getattr(base, f) for f in base.__struct_fields__}, "sampling": spans,
                              "behaviour_logprobs": behaviour})
    mb = collate([exact, base], [0, 1], [1.0, 1.0], pad_id=0)
    assert mb.rollout_logp[0, :n].tolist() == pytest.approx(behaviour) and behaviour != base.rollout_logprobs
    assert mb.rollout_logp[1, :n].tolist() == pytest.approx(base.rollout_logprobs)
    pk = pack([exact, base], [0, 1], [1.0, 1.0], 0)
    assert torch.equal(pk.rollout_logp, mb.rollout_logp * mb.mask)


def test_trainer_log_probs_use_each_tokens_sampling_temperature():
    """A trajectory whose turns sampled at different temperatures (and one greedy span): the
    trainer's log-probs must equal log_softmax(logits / T_t) of each token's own T_t, computed
    here from the plain model's logits."""
    model = load_model("builtin:tiny", seed=0)
    base = make_group(random.Random(3), "t", 2)[0]
    resp = [101, 102, 103, 104, 105, 106]
    spans = [SamplingSpan(start=0, temperature=0.5), SamplingSpan(start=2, temperature=0.0),
             SamplingSpan(start=4, temperature=1.7, top_p=0.95)]
    t = base.__class__(**{**{f: getattr(base, f) for f in base.__struct_fields__}, "token_ids": base.token_ids[:base.prompt_length] + resp,
                          "loss_mask": [1] * 6, "rollout_logprobs": [-1.0] * 6, "weight_versions": [0] * 6, "sampling": spans})
    mb = collate([t], [0], [1.0], pad_id=0)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    step = TrainStep(model, None, None, StepSettings.from_config(load_config(environ={}), 0), ctx)
    got = step._log_probs(model, mb)[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([t.token_ids])).logits[0].double()
    p = t.prompt_length
    temps = [0.5, 0.5, 1.0, 1.0, 1.7, 1.7]
    want = [torch.log_softmax(logits[p + i - 1] / temps[i], -1)[tok].item() for i, tok in enumerate(resp)]
    assert got.tolist() == pytest.approx(want, abs=1e-4)
    flat = [torch.log_softmax(logits[p + i - 1], -1)[tok].item() for i, tok in enumerate(resp)]
    assert abs(got[0].item() - flat[0]) > 1e-3, "the test must be able to tell temperatures apart"


def test_dummy_micro_batch_has_no_loss_tokens():
    mb = dummy_micro_batch(pad_id=3)
    assert mb.dummy and mb.mask.sum() == 0 and mb.input_ids.tolist() == [[3, 3]]


def test_lr_schedule_warmup_then_cosine_to_zero():
    assert lr_factor(0, 2, "cosine", 10) == 0.5 and lr_factor(1, 2, "cosine", 10) == 1.0
    assert lr_factor(2, 2, "cosine", 10) == pytest.approx(1.0) and lr_factor(10, 2, "cosine", 10) == pytest.approx(0.0)
    assert lr_factor(7, 0, "constant", None) == 1.0
    with pytest.raises(ValueError):
        lr_factor(3, 0, "cosine", None)


def test_prometheus_names_follow_verl_names():
    assert prometheus_name("trainer/idle_ratio") == "asyncrl_trainer_idle_ratio"
    assert prometheus_name("fully_async/partial/max_partial_span") == "asyncrl_fully_async_partial_max_partial_span"
    assert prometheus_name("actor/pg_clipfrac-high") == "asyncrl_actor_pg_clipfrac_high"


def test_metrics_hub_writes_jsonl_and_serves_loopback_prometheus(tmp_path):
    sent = []
    hub = MetricsHub(tmp_path, ["jsonl", "tensorboard"], "127.0.0.1", 0, send=sent.append)
    try:
        hub.emit(1, {"trainer/idle_ratio": 0.25, "actor/entropy": float("nan")})
        line = json.loads((tmp_path / "metrics" / "trainer.jsonl").read_text())
        assert line["step"] == 1 and line["trainer/idle_ratio"] == 0.25 and line["actor/entropy"] is None
        assert json.loads(sent[0])["trainer/idle_ratio"] == 0.25
        url = (tmp_path / "metrics" / "trainer_endpoint").read_text().strip()
        assert url.startswith("http://127.0.0.1:")
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        assert "asyncrl_trainer_idle_ratio 0.25" in body
        assert list((tmp_path / "tensorboard" / "trainer").glob("events.out.tfevents.*"))
    finally:
        hub.close()


def test_engine_weights_drop_tied_head_and_cast():
    full = {"model.embed_tokens.weight": torch.ones(2, 2), "lm_head.weight": torch.ones(2, 2), "n": torch.ones(2)}
    out = engine_weights(full, tied=True, dtype=torch.bfloat16)
    assert list(out) == ["model.embed_tokens.weight", "n"] and out["n"].dtype == torch.bfloat16
    assert "lm_head.weight" in engine_weights(full, tied=False)


def test_launcher_builds_torchrun_command_from_config():
    cfg = load_config(overrides=["trainer.nproc_per_node=2", "trainer.master_port=29999"], environ={})
    argv = torchrun_argv(cfg.trainer, ["cfg.yaml", "x=1"])
    assert argv[1:3] == ["-m", "trainer_daemon.torchrun"] and argv[-4:] == ["-m", "trainer_daemon", "cfg.yaml", "x=1"]
    assert argv[argv.index("--nproc-per-node") + 1] == "2" and argv[argv.index("--master-port") + 1] == "29999"
    multi = load_config(overrides=["trainer.nnodes=2"], environ={})
    with pytest.raises(ValueError):
        torchrun_argv(multi.trainer, [])


def test_only_marked_checkpoints_count(tmp_path):
    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000001" / MARKER).write_text("{}")
    (tmp_path / "step-00000002").mkdir()  # no marker: a crash after the rename can't happen, but be strict
    (tmp_path / "step-00000003.incomplete").mkdir()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1]


def test_io_loop_keeps_the_coroutines_own_timeout_message():
    import asyncio

    from trainer_daemon.io_loop import IoLoop

    async def fails():
        raise TimeoutError("NATS at nats://x did not accept connections")

    async def slow():
        await asyncio.sleep(30)  # a call that hangs (not a wait): the loop's bound must end it

    io = IoLoop()
    try:
        with pytest.raises(TimeoutError, match="did not accept"):
            io.run(fails(), 5)
        with pytest.raises(TimeoutError, match="did not finish within 0.1 s"):
            io.run(slow(), 0.1)
    finally:
        io.close()


@pytest.mark.parametrize(("overrides", "backend"), [
    ([], "gloo"),
    (["trainer.device=cuda"], "gloo"),  # local engines join gloo groups only, even with a CUDA trainer
    (["trainer.device=cuda", "engines.urls=[\"http://a:1\"]"], "gloo"),  # local engines started elsewhere
    (["trainer.device=cuda", "engines.backend=sglang"], "nccl"),
    (["engines.backend=sglang"], "gloo"),  # a CPU trainer has no NCCL
    (["trainer.device=cuda", "engines.backend=sglang", "trainer.weight_sync_backend=gloo"], "gloo"),
    (["engines.backend=local", "trainer.weight_sync_backend=nccl"], "nccl"),  # explicit wins
])
def test_weight_sync_backend_default_follows_the_engines(overrides, backend):
    from trainer_daemon.sync import weight_sync_backend

    cfg = load_config(overrides=overrides, environ={})
    assert weight_sync_backend(cfg.trainer, cfg.engines) == backend


def _one_step_delta(cfg, trajs, groups, weights) -> torch.Tensor:
    """The weight change of one SGD (lr 1) step of TrainStep on a fresh builtin:tiny."""
    from trainer_daemon.policy.model import build_scheduler

    torch.manual_seed(0)
    model = load_model("builtin:tiny", seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    step = TrainStep(model, opt, build_scheduler(opt, cfg.actor.optim, None), StepSettings.from_config(cfg, 0), ctx)
    metrics = step.run(trajs, groups, weights)
    assert metrics["fully_async/staleness/downweighted_trajectories"] == sum(w < 1 for w in weights or [])
    return torch.cat([(p.detach() - before[n]).flatten() for n, p in model.named_parameters()])


def test_staleness_weights_scale_each_trajectorys_policy_gradient():
    """Down-weighting multiplies a trajectory's advantage: weights of 0.5 everywhere halve the
    update (the PPO objective is positively homogeneous in the advantage), and weights 0 on one
    group give the update of a batch where that group carries no signal (equal rewards)."""
    cfg = load_config(overrides=["rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4",
                                 "actor.optim.grad_clip=1000"], environ={})
    rng = random.Random(4)
    trajs = [t for i in range(2) for t in make_group(rng, f"w{i}", 2, logprob=-6.5)]
    groups = [[0, 1], [2, 3]]
    full = _one_step_delta(cfg, trajs, groups, None)
    assert full.abs().max() > 1e-4
    half = _one_step_delta(cfg, trajs, groups, [0.5] * 4)
    assert torch.allclose(half, 0.5 * full, rtol=1e-4, atol=1e-7)
    silenced = _one_step_delta(cfg, trajs, groups, [1.0, 1.0, 0.0, 0.0])
    flat = [t.__class__(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "reward": 1.0}) if i >= 2 else t
            for i, t in enumerate(trajs)]
    assert torch.allclose(silenced, _one_step_delta(cfg, flat, groups, None), rtol=1e-4, atol=1e-7)


def _entropy_step(overrides: list[str]) -> dict[str, float]:
    from trainer_daemon.policy.model import build_scheduler

    cfg = load_config(overrides=["rollout.n=2", "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=2",
                                 *overrides], environ={})
    model = load_model("builtin:tiny", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    trajs = make_group(random.Random(6), "e", 2)
    step = TrainStep(model, opt, build_scheduler(opt, cfg.actor.optim, None), StepSettings.from_config(cfg, 0), ctx)
    return step.run(trajs, [[0, 1]]), model, trajs


def test_entropy_is_computed_only_when_asked_and_then_exactly():
    """``actor/entropy`` costs a pass over the vocabulary: absent by default, and with
    ``actor.calculate_entropy`` the token-mean entropy of the response positions, checked
    against the plain model's logits here (the metric path shares the log-softmax's logsumexp)."""
    m, _, _ = _entropy_step([])
    assert "actor/entropy" not in m and "actor/pg_loss" in m
    m, model, trajs = _entropy_step(["actor.calculate_entropy=true"])
    ents = []
    with torch.no_grad():
        for t in trajs:
            logits = model(input_ids=torch.tensor([t.token_ids])).logits[0].double()
            p = t.prompt_length
            for i in range(t.response_length):
                if t.loss_mask[i]:
                    q = torch.log_softmax(logits[p + i - 1], -1)
                    ents.append(-(q.exp() * q).sum().item())
    assert m["actor/entropy"] == pytest.approx(sum(ents) / len(ents), rel=1e-5)
    in_loss, _, _ = _entropy_step(["actor.entropy_coeff=0.01"])  # in the loss: the same value
    assert in_loss["actor/entropy"] == pytest.approx(m["actor/entropy"], rel=1e-6)


def test_one_rank_policy_is_plain_and_its_full_state_dict_is_a_copy(monkeypatch):
    """One rank trains the plain module (no FSDP); its full state dict must not alias the live
    parameters (a background sync reads it while the next step trains), and bf16 runs the
    forward under autocast with fp32 master weights."""
    import torch.distributed as dist

    from trainer_daemon.policy.model import build_policy, full_state_dict, is_sharded

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    from asyncrl.launch import free_port
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = build_policy("builtin:tiny", 0, torch.device("cpu"), 1, "bf16")
        assert not is_sharded(model) and all(p.dtype == torch.float32 for p in model.parameters())
        out = model(input_ids=torch.tensor([[5, 6, 7]])).logits
        assert out.dtype == torch.bfloat16
        full = full_state_dict(model)
        name, param = next(iter(model.named_parameters()))
        before = full[name].clone()
        with torch.no_grad():
            param.add_(1.0)
        assert torch.equal(full[name], before), "the full state dict aliases a live parameter"
    finally:
        dist.destroy_process_group()


def test_the_attention_kernel_follows_the_device_and_packing():
    """Packed rows need attention kept inside each sequence: flex (or flash-attention's varlen) on
    CUDA, where sdpa would take a dense mask; sdpa per sequence on the CPU, where flex has no
    backward (issue 31)."""
    from trainer_daemon.policy.model import attention_for, build_policy

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention_for("auto", cpu, True) == "segmented_sdpa" and attention_for("auto", cpu, False) == "sdpa"
    assert attention_for("auto", cuda, False) == "sdpa"
    assert build_policy("builtin:tiny", 0, cpu, 1, attn_implementation="segmented_sdpa").config._attn_implementation == "segmented_sdpa"
    assert attention_for("auto", cuda, True) in ("flex_attention", "flash_attention_2")
    assert attention_for("eager", cuda, True) == "eager"
    assert build_policy("builtin:tiny", 0, cpu, 1, attn_implementation="eager").config._attn_implementation == "eager"
