"""Issue 53: routing replay on fixed tensors (trainer_daemon/compute/router_replay.py).
Replaying the routes the model would choose itself changes nothing: logits and every gradient
equal the unpatched model's, bit for bit; replaying other routes changes the output, keeps the
router's gradient, and counts the flips; ``-1`` rows route live; activation checkpointing's
recompute in backward replays the same routes (gradients equal the plain backward's)."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.models import load_model
from local_engine.routes import RouteRecorder
from trainer_daemon.compute.router_replay import RouterReplay, routers_of

IDS = torch.tensor([[5, 17, 300, 42, 8, 99, 260, 11, 7, 31], [64, 3, 18, 255, 1000, 77, 12, 9, 401, 5]])


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return load_model("builtin:tiny-moe", dtype="float32", seed=3).train()


def live_routes(model) -> torch.Tensor:
    probe = copy.deepcopy(model)
    rec = RouteRecorder(probe)
    with torch.no_grad():
        probe(input_ids=IDS)
    return rec.take().long()


def loss_and_grads(model, routes=None, replay=None):
    model.zero_grad()
    ctx = replay.active(routes) if replay is not None else torch.enable_grad()
    with ctx:
        logits = model(input_ids=IDS).logits
        loss = logits.float().log_softmax(-1)[:, :-1].gather(-1, IDS[:, 1:, None]).sum()
        loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_replaying_the_models_own_routes_is_the_plain_forward_bit_for_bit(base):
    plain = copy.deepcopy(base)
    replayed = copy.deepcopy(base)
    replay = RouterReplay(replayed)
    routes = live_routes(base)
    want_logits, want_grads = loss_and_grads(plain)
    got_logits, got_grads = loss_and_grads(replayed, routes, replay)
    assert torch.equal(got_logits, want_logits)
    assert want_grads.keys() == got_grads.keys()
    for name, g in want_grads.items():
        assert torch.equal(got_grads[name], g), name
    assert replay.take_counts() == (0, IDS.numel() * 4), "no flip: every (token, layer) routed as the model would"
    outside, _ = loss_and_grads(replayed)  # outside active(): the module's own routing
    assert torch.equal(outside, want_logits)


def test_other_routes_change_the_output_keep_the_router_gradient_and_count_as_flips(base):
    model = copy.deepcopy(base)
    replay = RouterReplay(model)
    routes = live_routes(base)
    forced = routes.clone()
    forced[:, :, 0] = (routes[:, :, 0] + 1) % 8
    forced[:, :, 1] = (routes[:, :, 0] + 2) % 8  # a set that differs from the live one everywhere
    same = (forced.sort(-1).values == routes.sort(-1).values).all(-1)
    forced[0] = -1  # the first position of the first row: route live
    logits, grads = loss_and_grads(model, forced, replay)
    plain_logits, _ = loss_and_grads(copy.deepcopy(base))
    assert not torch.allclose(logits, plain_logits)
    for router_name in [n for n, _ in model.named_modules() if n.endswith("mlp.gate")]:
        assert grads[f"{router_name}.weight"].abs().sum() > 0, f"{router_name} keeps its gradient"
    flips, routed = replay.take_counts()
    assert routed == (IDS.numel() - 1) * 4 and flips == routed - int(same.view(-1, 4)[1:].sum())


def test_activation_checkpointing_recomputes_with_the_same_routes(base):
    routes = live_routes(base)
    routes[:, :, 0] = (routes[:, :, 0] + 3) % 8
    routes[:, :, 1] = torch.where(routes[:, :, 1] == routes[:, :, 0], (routes[:, :, 1] + 1) % 8, routes[:, :, 1])
    plain = copy.deepcopy(base)
    checkpointed = copy.deepcopy(base)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    want = loss_and_grads(plain, routes, RouterReplay(plain))
    got = loss_and_grads(checkpointed, routes, RouterReplay(checkpointed))
    assert torch.equal(got[0], want[0])
    for name, g in want[1].items():
        assert torch.allclose(got[1][name], g, rtol=0, atol=1e-6), name


def test_a_dense_model_and_misshapen_routes_are_refused(base):
    with pytest.raises(ValueError, match="mixture-of-experts"):
        RouterReplay(load_model("builtin:tiny", dtype="float32"))
    other = copy.deepcopy(base)
    for router in routers_of(other):
        router.__class__ = type("SigmoidTopKRouter", (router.__class__,), {})  # a router computing otherwise
    with pytest.raises(ValueError, match="SigmoidTopKRouter"):
        RouterReplay(other)
    replay = RouterReplay(copy.deepcopy(base))
    with pytest.raises(ValueError, match="needs"):
        with replay.active(torch.zeros((4, 3, 2), dtype=torch.long)):
            pass
    assert len(routers_of(base)) == 4
