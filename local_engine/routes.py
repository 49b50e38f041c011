"""Routed experts (issue 53): which experts a mixture-of-experts model's routers chose for every
token a request put through the model, returned as SGLang returns them.

SGLang's protocol (every release 0.5.15-0.5.23, read from the wheels):

- the server flag ``--enable-return-routed-experts`` (off by default); a model without a top-k
  router (``num_experts_per_tok`` in its config) cannot start with it;
- the request fields ``return_routed_experts`` (bool) and ``routed_experts_start_len`` (int,
  default 0), top level on ``/generate``, scalars even for a batch; with the flag off a request
  asking for routes is answered without them, silently;
- the answer's ``meta_info["routed_experts"]``: base64 of little-endian int32, shape
  ``(rows, num_hidden_layers, num_experts_per_tok)`` with no header, ``rows = prompt_tokens +
  completion_tokens - 1 - routed_experts_start_len``; row ``r`` is the routing when the token
  at position ``start_len + r`` was the model's input (the last sampled token was never an
  input: it has none). Only the final answer carries it (a stream's last chunk), an abort of a
  running request too (its partial rows), a request aborted while queued none.
- KV taken from a cache keeps the routes computed with it (SGLang keeps them per KV slot): a
  retracted request's re-prefill over its kept prompt KV reports the prompt's first routes;
  positions computed again report the new ones.

:class:`RouteRecorder` collects the per-layer top-k indices of one forward from every router
module (transformers' ``*TopKRouter``: ``(logits, scores, indices)``), in layer order.
"""

from __future__ import annotations

import base64

import torch

ROUTER_SUFFIX = "TopKRouter"


def top_k_of(config) -> int | None:
    """Experts routed per token, or None for a dense model."""
    k = getattr(config, "num_experts_per_tok", None)
    return int(k) if k else None


class RouteRecorder:
    """Forward hooks on a model's routers; after a forward, :meth:`take` gives the indices as
    ``[tokens, layers, top_k]`` int32 on the CPU (tokens in the forward's flattened order)."""

    def __init__(self, model) -> None:
        self.routers = [m for m in model.modules() if type(m).__name__.endswith(ROUTER_SUFFIX)]
        if not self.routers:
            raise ValueError("this model has no top-k router (not a mixture of experts): it cannot return routed experts")
        self.layers = int(model.config.num_hidden_layers)
        self.top_k = top_k_of(model.config)
        if len(self.routers) != self.layers:  # dense layers (mlp_only_layers) report zero rows, as SGLang's do
            names = {id(m): n for n, m in model.named_modules()}
            self.layer_of = [int(names[id(m)].split("layers.")[1].split(".")[0]) for m in self.routers]
        else:
            self.layer_of = list(range(self.layers))
        self._seen: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(module, args, output) -> None:
            self._seen[i] = output[2].detach()

        return hook

    def take(self) -> torch.Tensor:
        """The last forward's routes ``[tokens, layers, top_k]`` (int32, CPU); cleared after."""
        seen = [t for t in self._seen if t is not None]
        tokens = seen[0].shape[0] if seen else 0
        out = torch.zeros((tokens, self.layers, self.top_k), dtype=torch.int32)
        for layer, t in zip(self.layer_of, self._seen, strict=True):
            if t is not None:
                out[:, layer] = t.to(device="cpu", dtype=torch.int32)
        self._seen = [None] * len(self.routers)
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def encode_routes(rows: torch.Tensor) -> str:
    """``meta_info["routed_experts"]``: base64 of the rows as little-endian int32, no header."""
    return base64.b64encode(rows.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()).decode("ascii")
