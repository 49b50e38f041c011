"""What a decoded trajectory must satisfy before the trainer holds it: the checks that need the
run and the model, beyond the wire invariants (issue 30 item 6).

- ``run_id`` is this run's: a message of another run (a misrouted publisher, a reused stream)
  must not train this policy;
- every token id is below the policy's vocabulary (its embedding rows): an id beyond it makes
  the embedding lookup fail inside the step;
- the sequence is at most ``model.max_model_len`` tokens: longer ones exceed what the run
  was sized for (and the position embeddings of many models);
- routed experts (issue 53) fit the policy: none for a dense model; under router replay
  (``actor.router_replay.mode = "R3"``) a trainable trajectory must carry them, of the model's
  layers and top-k, every expert id below its number of experts (an id beyond it would index
  past the expert weights inside the step).

A trajectory that fails is *poison*: terminated, copied to the dead-letter subject with the
reason, counted — never held, so it can neither crash a step nor be replayed after every
restart (a crash loop). The run goes on with the rest of its group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from asyncrl.wire import Trajectory
from asyncrl.wire.routed_experts import no_route


@dataclass(frozen=True)
class PolicyRouting:
    """The policy's routing, for the routed-experts checks: ``experts`` 0 for a dense model;
    ``replay``: ``actor.router_replay.mode`` is R3."""

    layers: int = 0
    top_k: int = 0
    experts: int = 0
    replay: bool = False

    @classmethod
    def of(cls, model_config, replay: bool) -> PolicyRouting:
        experts = int(getattr(model_config, "num_experts", 0) or getattr(model_config, "n_routed_experts", 0) or 0)
        top_k = int(getattr(model_config, "num_experts_per_tok", 0) or 0)
        return cls(int(model_config.num_hidden_layers), top_k, experts if top_k else 0, replay)


def admission_check(run_id: str, vocab_size: int, max_tokens: int,
                    routing: PolicyRouting = PolicyRouting()) -> Callable[[Trajectory], str]:
    """A function naming why a trajectory cannot be trained by this run's policy, or ""."""
    if vocab_size < 1 or max_tokens < 1:
        raise ValueError(f"vocab_size ({vocab_size}) and max_tokens ({max_tokens}) must be >= 1")

    def reason(traj: Trajectory) -> str:
        if traj.run_id != run_id:
            return f"run_id {traj.run_id[:80]!r} is not this run's ({run_id!r})"
        if len(traj.token_ids) > max_tokens:
            return f"{len(traj.token_ids)} tokens exceed model.max_model_len = {max_tokens}"
        top = max(traj.token_ids, default=0)
        if top >= vocab_size:
            return f"token id {top} is outside the policy's vocabulary of {vocab_size}"
        return _routes_reason(traj, routing)

    return reason


def _routes_reason(traj: Trajectory, routing: PolicyRouting) -> str:
    r = traj.routed_experts
    if r is None:
        if routing.replay and not traj.failure:
            return "no routed_experts: actor.router_replay.mode R3 trains on the engines' routes (start the engines with --enable-return-routed-experts)"
        return ""
    if not routing.experts:
        return "routed_experts for a dense policy (it has no experts to route to)"
    if (r.layers, r.top_k) != (routing.layers, routing.top_k):
        return f"routed_experts of {r.layers} layers x top-{r.top_k}; the policy has {routing.layers} x top-{routing.top_k}"
    rows = r.array()
    reported = (rows != no_route(r.width)).any(axis=(1, 2))  # rows the engine did not report: routed live
    top = int(rows[reported].max()) if reported.any() else 0
    if top >= routing.experts:
        return f"expert id {top} in routed_experts is outside the policy's {routing.experts} experts"
    ranked = np.sort(rows, axis=-1)
    repeated = np.argwhere((ranked[..., 1:] == ranked[..., :-1]).any(axis=-1) & reported[:, None])
    if repeated.size:  # a router's top-k are k distinct experts (issue 67: duplicates were admitted)
        position, layer = (int(x) for x in repeated[0])
        return f"routed_experts repeats an expert within layer {layer}'s top-{r.top_k} (row {position})"
    return ""
