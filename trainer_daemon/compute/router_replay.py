"""Routing replay (R3, issue 53): the trainer's mixture-of-experts forward takes the experts the
engine routed each token to, while the routing weights still come from the trainer's own router
logits — so the experts match those that sampled the tokens and the router keeps its gradient.

Installed per model instance on every top-k router module of the kinds whose computation it
reproduces (:data:`ROUTERS`: transformers' Qwen2-MoE and Qwen3-MoE routers, softmax then top-k,
``forward(hidden) -> (logits, scores, indices)``; any other router is refused at install: its
own forward may compute otherwise, e.g. a sigmoid with an expert bias); the patched forward is
the module's own computation with one change: under :meth:`RouterReplay.active`
the indices are the given routes instead of the top-k of the live probabilities, and the scores
are the live probabilities gathered at those indices (renormalised when the model normalises
its top-k), cast as the original casts them. Where the routes hold ``-1`` (a sequence's last
position, which no engine call put through the model; padding) the live top-k is taken. With
routes equal to the live top-k the result is bit for bit the unpatched one
(``tests/trainer/test_router_replay.py``); without :meth:`active` the module behaves as before.

Layout: routes are ``[tokens, layers, top_k]`` in the order the routers see the tokens (the
micro-batch's ``input_ids`` flattened: rows of a padded batch one after another, or the packed
row). Activation checkpointing: the non-reentrant recompute in backward runs the routers again,
so :meth:`active` must span the backward too (the step holds it around forward and backward).

Each router reads its own layer's routes from an attribute :meth:`active` sets (no lookup by
module identity inside the forward: ``torch.compile`` of a decoder block would guard on it and
recompile per layer).

Flips (with ``count``, the policy's): under :meth:`active`, every router counts the (token, layer) pairs whose live top-k set
differs from the replayed one (``flips`` / ``routed``): how often the trainer alone would have
chosen other experts (``actor/router_replay/flip_rate``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F

ROUTER_SUFFIX = "TopKRouter"
ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")
"""Router classes whose forward the replay reproduces exactly (softmax, top-k, optional renormalisation)."""


def routers_of(model) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith(ROUTER_SUFFIX)]


class RouterReplay:
    """The replay state of one model (module docstring)."""

    def __init__(self, model, count: bool = True) -> None:
        routers = routers_of(model)
        if not routers:
            raise ValueError("actor.router_replay.mode R3 needs a mixture-of-experts model: this one has no top-k router")
        unknown = sorted({type(m).__name__ for m in routers} - set(ROUTERS))
        if unknown:
            raise ValueError(f"router replay reproduces {', '.join(ROUTERS)} only; this model routes with {', '.join(unknown)}")
        self.count = count
        names = {id(m): n for n, m in model.named_modules()}
        self.layers = int(model.config.num_hidden_layers)
        self.top_k = int(model.config.num_experts_per_tok)
        self.num_experts = int(routers[0].num_experts) if hasattr(routers[0], "num_experts") else int(routers[0].weight.shape[0])
        self.layer_of = {id(m): int(names[id(m)].split("layers.")[1].split(".")[0]) for m in routers}
        self.routers = routers
        self.routes: torch.Tensor | None = None
        self._counts: list[tuple[torch.Tensor, torch.Tensor]] = []  # on the device: read once per step
        for router in routers:
            router._replay_routes = None
            router.forward = types.MethodType(_replaying_forward(self), router)

    @contextlib.contextmanager
    def active(self, routes: torch.Tensor | None) -> Iterator[None]:
        """Replay ``routes`` (``[tokens, layers, top_k]``; None: route live) in every forward —
        and backward recompute — inside the block."""
        if routes is not None and (routes.dim() != 3 or routes.shape[1:] != (self.layers, self.top_k)):
            raise ValueError(f"routes of shape {tuple(routes.shape)}; the model needs [tokens, {self.layers}, {self.top_k}]")
        previous, self.routes = self.routes, routes
        self._give(routes)
        try:
            yield
        finally:
            self.routes = previous
            self._give(previous)

    def _give(self, routes: torch.Tensor | None) -> None:
        for router in self.routers:
            router._replay_routes = None if routes is None else routes[:, self.layer_of[id(router)]]

    def take_counts(self) -> tuple[int, int]:
        """``(flips, routed)`` since the last call (module docstring; a recompute in backward
        counts its routes again, flips and routed alike: the rate is unchanged)."""
        counts, self._counts = self._counts, []
        if not counts:
            return 0, 0
        return int(sum(f for f, _ in counts)), int(sum(r for _, r in counts))


def _replaying_forward(replay: RouterReplay):
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        given = self._replay_routes
        if given is not None:
            if given.shape[0] != router_indices.shape[0]:
                raise ValueError(f"routes for {given.shape[0]} tokens; this forward routes {router_indices.shape[0]}")
            given = given.to(device=router_indices.device, dtype=router_indices.dtype)
            known = (given >= 0).all(-1, keepdim=True)
            if replay.count:
                with torch.no_grad():
                    differ = (given.sort(-1).values != router_indices.sort(-1).values).any(-1) & known.squeeze(-1)
                    replay._counts.append((differ.sum(), known.sum()))
            router_indices = torch.where(known, given, router_indices)
            router_top_value = router_probs.gather(1, router_indices)
        if self.norm_topk_prob:
            router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
        router_top_value = router_top_value.to(router_logits.dtype)
        return router_logits, router_top_value, router_indices

    return forward
