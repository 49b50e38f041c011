"""Continuous batching: one asyncio task steps the model for every running request at once.

Each iteration of the loop, on the event loop thread:

1. rows whose request finished or was aborted are dropped (lazily, in the next compute);
2. if requests wait and there is room (``max_batch_size`` rows, ``MAX_PREFILL_TOKENS``
   padded prompt tokens per prefill), they are prefilled together in one forward pass and
   joined to the running batch — their first token is sampled by that pass;
3. otherwise every running row decodes one token in one batched forward pass.

While rows are running, prefill steps alternate with decode steps, so a steady stream of
arrivals cannot stall the running batch.

Model compute and sampling run in a worker thread (``asyncio.to_thread``) so HTTP stays
responsive; at most one compute is in flight. A new request therefore waits at most one
step before it is prefilled, never for others to finish.

Control, all on the event loop:

- ``abort(prefix | all)``: a queued request ends at once as "Abort in waiting queue"; a
  running one ends at once with its partial output and ``finish_reason`` abort (a compute
  in flight for it is discarded on return).
- ``stop_stepping()`` / ``start_stepping()``: pause (in place) without losing rows or KV;
  ``stop_stepping`` returns once no compute is in flight.
- ``retract_all()`` (while stopped): SGLang's ``retract`` pause — every running request goes
  back to the front of the queue in order, its rows and KV freed; it is prefilled again from
  its prompt plus the output so far when stepping resumes (with whatever weights are loaded
  then), and its next token comes from that prefill. ``num_retractions`` counts it. As in
  SGLang, the KV of its prompt stays in the prefix cache: the re-prefill takes it from there
  (computed with the weights of before the retract; ``cached_tokens`` counts it) and computes
  only the output so far, unless a cache flush dropped it first (``drop_cached_prompts()``,
  called on every successful flush). A sync flushes after the retract: SGLang 0.5.21+ flush
  while retracted requests are queued, 0.5.20 and older refuse (``local_engine.compat``), so
  there the prompt's KV after a retract sync is the old weights'.
- ``hold()``: an async context during which no compute runs (weight copies use it).

Prefix cache (``prefix_cache``, :mod:`local_engine.prefix_cache`; None under
``--disable-radix-cache``): a running request ended by an abort leaves its KV there, taken
before its row is dropped, while no compute is in flight; a prefill of a request with no KV
of its own takes the longest cached prefix of its context (``cached_tokens`` counts it). A
flush empties it.

Overlap (``last_step``): the requests that got a token from the most recent step, which
SGLang's overlap scheduler would still hold as a pending result at an ``in_place`` pause
(:meth:`local_engine.engine.Engine.pause`).

A compute that raises ends the requests it involved with an abort carrying status 500
and resets the batch; the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import torch

from asyncrl import failpoints
from local_engine.prefix_cache import PrefixCache
from local_engine.request import Req, StopChecker
from local_engine.runner import ModelRunner
from local_engine.sampler import RowSampling, SampleOutput, prompt_logprobs, sample

log = logging.getLogger(__name__)

# Padded prompt tokens (rows × longest prompt) one prefill may process: bounds how long a
# burst of arrivals can stall the running decode batch (~0.1-0.5 s on 2 cores for 135M).
MAX_PREFILL_TOKENS = 8192


class Scheduler:
    """Owns the waiting queue, the running rows and the loop that steps them."""

    def __init__(
        self,
        runner: ModelRunner,
        stop_checker: StopChecker,
        version_fn: Callable[[], str],
        max_batch_size: int,
        seed: int = 0,
        on_step: Callable[[str, int, int], None] | None = None,
        sampling_mask_max_tokens: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.last_step: list[Req] = []
        """Requests that got a token from the most recent step (module docstring, "Overlap")."""
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        """SGLang 0.5.20+ ``--sampling-mask-max-tokens``: a request whose sampling support is
        larger ends with an abort (400); None: no limit (0.5.19)."""
        self.stops = stop_checker
        self.version_fn = version_fn
        self.max_batch_size = max_batch_size
        self.on_step = on_step or (lambda kind, rows, tokens: None)
        self.waiting: deque[Req] = deque()
        self.rows: list[Req] = []  # aligned with the runner's rows
        self._generator = torch.Generator().manual_seed(seed)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopped = False
        self.forward_sleep_s: float | None = None
        """SGLang's ``/slow_down`` (``forward_sleep_time``): each step sleeps this long first
        (tests hold a generation mid-way with it on both engines); None: no sleep."""
        self._holds = 0
        self._task: asyncio.Task | None = None
        self._admitting: list[Req] = []  # popped from waiting, not yet in rows (a failing prefill ends them)
        self._prefilled_last = False  # the previous step was a prefill: decode next if rows run
        self.max_decode_batch = 0
        self.last_decode_batch = 0
        self.steps = 0

    # -- introspection -------------------------------------------------------------------
    @property
    def running(self) -> list[Req]:
        return [r for r in (*self.rows, *self._admitting) if not r.finished]

    @property
    def num_pending(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="local_engine.scheduler")

    async def close(self, message: str = "engine shutting down") -> None:
        self.abort(abort_all=True, message=message)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    # -- requests ------------------------------------------------------------------------
    def submit(self, req: Req) -> None:
        self.waiting.append(req)
        self._wake.set()

    def find(self, rid: str) -> Req | None:
        for req in (*self.waiting, *self.rows, *self._admitting):
            if req.rid == rid and not req.finished:
                return req
        return None

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Aborted", status: int | None = None) -> int:
        """End matching requests now (rid matched as a prefix). Returns how many ended."""
        if not abort_all and not rid:
            return 0

        def hit(req: Req) -> bool:
            return not req.finished and (abort_all or req.rid.startswith(rid))

        count = 0
        for req in [r for r in self.waiting if hit(r)]:
            self.waiting.remove(req)
            req.aborted_in_queue = True
            req.finish({"type": "abort", "message": "Abort in waiting queue", "status_code": status, "err_type": None})
            count += 1
        for req in (*self.rows, *self._admitting):
            if hit(req):
                req.finish({"type": "abort", "message": message, "status_code": status, "err_type": None})
                count += 1
        self._wake.set()
        return count

    def abort_one(self, req: Req, message: str) -> None:
        """End exactly this request (queued, running, or not yet submitted)."""
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
            req.aborted_in_queue = True
            message = "Abort in waiting queue"
        req.finish({"type": "abort", "message": message, "status_code": None, "err_type": None})
        self._wake.set()

    # -- pause / exclusive access --------------------------------------------------------
    async def stop_stepping(self) -> None:
        self._stopped = True
        await self._idle.wait()

    def start_stepping(self) -> None:
        self._stopped = False
        self._wake.set()

    def retract_all(self) -> int:
        """Free every running row (call while stopped); returns how many requests went back to the queue."""
        back = [(i, r) for i, r in enumerate(self.rows) if not r.finished]
        self._checkpoint_aborted()
        for i, req in reversed(back):
            req.retractions += 1
            req.kept_prompt_kv = self.runner.export_prefix(i, len(req.prompt_ids))
            if req.route_rows:  # the routes stay with the kept KV; recomputed positions get new ones
                req.kept_prompt_routes = torch.cat(req.route_rows)[: len(req.prompt_ids)] if req.kept_prompt_kv is not None else None
                req.route_rows = []
            self.waiting.appendleft(req)
        self.rows = []
        self.runner.reset()
        self._prefilled_last = False
        return len(back)

    def drop_cached_prompts(self) -> None:
        """A cache flush: no queued request reuses the prompt KV kept at its retract, and the
        prefix cache is empty."""
        for req in self.waiting:
            req.kept_prompt_kv = None
            req.kept_prompt_routes = None
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _checkpoint_aborted(self) -> None:
        """Keep the KV of running requests an abort ended in the prefix cache, before their rows
        go (called on the event loop between computes: the runner is idle)."""
        if self.prefix_cache is None:
            return
        for i, req in enumerate(self.rows):
            reason = req.finish_reason
            if req.kv_released or reason is None or reason.get("type") != "abort" or reason.get("status_code"):
                continue
            req.kv_released = True
            n = min(len(req.context_ids), len(req.prompt_ids) + len(req.output_ids) - 1)
            kv = self.runner.export_prefix(i, n) if n > 0 else None
            if kv is None:
                continue
            routes = torch.cat(req.route_rows)[:n] if req.route_rows else None
            self.prefix_cache.insert((req.prompt_ids + req.output_ids)[:n], kv,
                                     routes if routes is not None and len(routes) == n else None, req.lora_name)

    def _take_cached_prefix(self, req: Req) -> None:
        """A cache hit for a request prefilled without KV of its own."""
        if self.prefix_cache is None or req.kept_prompt_kv is not None or req.wants_prompt_logits:
            return
        hit = self.prefix_cache.match(req.context_ids, req.lora_name, req.return_routed_experts)
        if hit is not None:
            req.kept_prompt_kv, req.kept_prompt_routes = hit.kv, hit.routes

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        self._holds += 1
        try:
            await self._idle.wait()
            yield
        finally:
            self._holds -= 1
            self._wake.set()

    # -- the loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            self._checkpoint_aborted()
            if not self.running and self.rows:
                self.rows = []
                self.runner.reset()
            if self._stopped or self._holds or not (self.waiting or self.running):
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._idle.clear()
            try:
                await self._step()
            except Exception as exc:  # a model failure must not kill the engine
                log.exception("model step failed")
                for req in [*self.rows, *self._admitting]:
                    req.finish({"type": "abort", "message": f"engine error: {exc}", "status_code": 500, "err_type": type(exc).__name__})
                self.rows = []
                self.runner.reset()
            finally:
                self._admitting = []
                self._idle.set()

    def _admit(self, live: int) -> list[Req]:
        admitted: list[Req] = []
        longest = 0
        while self.waiting and live + len(admitted) < self.max_batch_size:
            nxt = self.waiting[0]
            width = max(longest, len(nxt.context_ids))
            if admitted and width * (len(admitted) + 1) > MAX_PREFILL_TOKENS:
                break
            admitted.append(self.waiting.popleft())
            longest = width
        return admitted

    async def _step(self) -> None:
        await failpoints.hold_async("local_engine.step")  # tests: a generation held mid-way, deterministically
        if self.forward_sleep_s:  # SGLang's /slow_down: every forward waits this long first
            await asyncio.sleep(self.forward_sleep_s)
        self._checkpoint_aborted()  # an abort may have come while the step waited above
        keep = [i for i, r in enumerate(self.rows) if not r.finished]
        live = [self.rows[i] for i in keep]
        admitted = self._admitting = [] if (live and self._prefilled_last) else self._admit(len(live))
        self._prefilled_last = bool(admitted)
        for req in admitted:
            self._take_cached_prefix(req)
        version = self.version_fn()
        eos = self.stops.eos_ids
        if admitted:
            rows = [r.row_sampling(eos) for r in admitted]
            tops = [r.top_logprobs_num for r in admitted]
            out, prompt_lps, routes = await asyncio.to_thread(self._prefill, keep, admitted, rows, tops)
            for i, req in enumerate(admitted):
                if routes is not None and req.return_routed_experts:  # the context's: kept with a cached prompt's KV, else computed
                    kept = [req.kept_prompt_routes] if req.kept_prompt_kv is not None and req.kept_prompt_routes is not None else []
                    req.route_rows = [*kept, routes[i]]
                    req.kept_prompt_routes = None
                if req.kept_prompt_kv is not None:  # its first tokens' KV came from the prefix cache
                    req.cached_tokens += int(req.kept_prompt_kv[0][0].shape[-2])
                    req.kept_prompt_kv = None
            self.rows = live + admitted
            for req, lps in zip(admitted, prompt_lps, strict=True):
                if lps is not None:
                    req.input_logprobs = lps
            self._apply(admitted, out, version, skip_zero_budget=True)
            self.last_step = admitted
            self.on_step("prefill", len(admitted), sum(len(r.context_ids) for r in admitted))
        else:
            rows = [r.row_sampling(eos) for r in live]
            tops = [r.top_logprobs_num for r in live]
            last = [r.output_ids[-1] for r in live]
            out, routes = await asyncio.to_thread(self._decode, keep, last, rows, tops)
            self.rows = live
            if routes is not None:
                for i, req in enumerate(live):
                    if req.return_routed_experts and not req.finished:  # one aborted while the step ran keeps its rows
                        req.route_rows.append(routes[i:i + 1])
            self._apply(live, out, version)
            self.last_step = live
            self.last_decode_batch = len(live)
            self.max_decode_batch = max(self.max_decode_batch, len(live))
            self.on_step("decode", len(live), len(live))
        self.steps += 1

    def _apply(self, reqs: list[Req], out: SampleOutput, version: str, skip_zero_budget: bool = False) -> None:
        for i, req in enumerate(reqs):
            if req.finished:  # aborted while the step ran
                continue
            if skip_zero_budget and req.params.max_new_tokens == 0:
                req.finish({"type": "length", "length": 0})
                continue
            if not math.isfinite(out.logprobs[i]):
                req.finish({"type": "abort", "message": "non-finite logits: the model produced NaN/inf", "status_code": 500,
                            "err_type": "NonFiniteLogits"})
                continue
            mask = out.masks[i] if out.masks else None
            if mask is not None and self.sampling_mask_max_tokens is not None \
                    and len(mask.support) > self.sampling_mask_max_tokens:
                req.finish({"type": "abort", "message": overflow_message(self.sampling_mask_max_tokens),
                            "status_code": 400, "err_type": "BadRequestError"})
                continue
            req.append(out.token_ids[i], out.logprobs[i], out.top[i], version, mask)
            reason = self.stops.check(req)
            if reason is not None:
                req.finish(reason)
            else:
                req.updated.set()

    # -- worker-thread compute -----------------------------------------------------------
    def _prefill(self, keep: list[int], reqs: list[Req], rows: list[RowSampling], tops: list[int]):
        self.runner.keep(keep)
        prefixes = [r.kept_prompt_kv for r in reqs]
        pf = self.runner.prefill([r.context_ids for r in reqs], [r.wants_prompt_logits for r in reqs],
                                 [r.adapter.weights if r.adapter is not None else None for r in reqs],
                                 prefixes if any(p is not None for p in prefixes) else None)
        out = sample(pf.last, rows, self._generator, tops)
        lps = [
            prompt_logprobs(logits, r.prompt_ids, r.params.temperature) if logits is not None else None
            for r, logits in zip(reqs, pf.prompt, strict=True)
        ]
        return out, lps, pf.routes

    def _decode(self, keep: list[int], tokens: list[int], rows: list[RowSampling], tops: list[int]) -> SampleOutput:
        self.runner.keep(keep)
        logits = self.runner.decode(tokens)
        return sample(logits, rows, self._generator, tops), self.runner.decode_routes


def overflow_message(limit: int) -> str:
    """SGLang's (0.5.20+) message for a sampling support over ``--sampling-mask-max-tokens``."""
    return (f"Sampling support exceeds --sampling-mask-max-tokens={limit}, commonly because of cutoff ties. "
            "Lower top_k to leave more headroom or increase the server limit.")
