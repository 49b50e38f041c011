"""The engine core, free of HTTP: validation, the lock discipline, pause, weight updates.

Lock discipline (copied from SGLang's tokenizer manager, contract §1):

- ``/generate`` waits at the pause gate, then holds the reader lock until it answers; a
  request waiting at the gate is not yet known to the engine (an exact-rid abort misses it);
- weight updates (and opening/closing a weight-update session) take the writer lock — they
  wait for in-flight generations — unless the engine is paused, in which case they hold the
  *pause condition* instead for their whole duration: ``/pause_generation`` and
  ``/continue_generation`` wait for them (SGLang: ``is_pause_cond``). The copy into the
  parameters additionally holds the scheduler, so it never overlaps a model step;
- ``pause(abort)``: close the gate, then abort everything running or queued until no
  ``/generate`` is in flight (bounded by ``pause_drain_timeout_s``); their callers get
  partial results with finish_reason abort;
- ``pause(in_place)``: close the gate and stop stepping after the current step; requests
  keep their rows and KV and go on after ``resume()``, with the new weights if an update
  happened meanwhile (recorded in ``weight_versions`` spans) on top of KV computed with the
  old ones. Unless ``--disable-overlap-schedule``, the token each request got from the last
  step is still pending at the pause, as in SGLang's overlap scheduler (it processes a batch's
  result after launching the next one, and an in_place pause leaves the last result queued):
  at ``resume()`` it is stamped with the version then, so an update in between labels that
  old-weight token with the new version (issue 66 N2; a request whose first token was pending
  gets no old span at all). Not copied: a request that *finished* with that token answers
  before the pause here, after the resume in SGLang;
- ``pause(retract)``: the same, then every running request goes back to the queue with its
  KV freed; after ``resume()`` it is prefilled again (prompt + output so far) with the
  weights loaded then, and its ``num_retractions`` counts it;
- a cache flush (``/flush_cache`` or an update's ``flush_cache``) needs no running request
  and no queued one, except that from 0.5.21 on a paused engine ignores its queue (so a flush
  after ``retract`` works there and fails on older releases; after ``in_place`` it fails).

Weight-update sessions (SGLang 0.5.21+, :mod:`local_engine.compat`): distributed updates are
refused outside ``begin_weight_update`` … ``end_weight_update``. Aborts: a rid is honoured only
when it matches a request the engine tracks exactly (then, like SGLang's scheduler, every
request whose rid starts with it ends); ``abort_all`` ends everything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from pydantic import ValidationError

from asyncrl.lora_targets import normalized_targets
from local_engine.errors import (
    RANGE_ERRORS,
    ContractError,
    InternalError,
    Refused,
    validation_message,
)
from local_engine.flush import CacheFlush
from local_engine.locks import PauseGate, RWLock
from local_engine.lora import AdapterStore, LoraError, lora_path_spec, read_adapter_config
from local_engine.metrics import EngineMetrics
from local_engine.prefix_cache import PrefixCache
from local_engine.protocol import (
    GenerateBody,
    SamplingParams,
    UpdateDiskBody,
    UpdateDistributedBody,
)
from local_engine.request import Renderer, Req, StopChecker
from local_engine.runner import HFModelRunner, ModelRunner
from local_engine.scheduler import Scheduler
from local_engine.settings import EngineSettings
from local_engine.weights import WeightManager, WeightUpdateError

log = logging.getLogger(__name__)
FATAL_EXIT = 70  # EX_SOFTWARE: the exit status of --sglang-fatal-errors

PAUSE_DRAIN_POLL_S = 0.01  # abort-all repeat interval while draining in-flight /generate calls


def _eos_ids(config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return frozenset(ids)


class Engine:
    """One model, its scheduler and its weights; every route calls into this."""

    def __init__(self, settings: EngineSettings, runner: ModelRunner, tokenizer, model_config):
        self.settings = settings
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = model_config
        self.vocab_size = runner.vocab_size
        self.max_model_len = settings.max_model_len or int(getattr(model_config, "max_position_embeddings", 4096))
        self.eos_ids = _eos_ids(model_config, tokenizer)
        self.metrics = EngineMetrics()
        if hasattr(runner, "recomputed_tokens"):  # timing mode: context re-prefilled after an abort or retract
            self.metrics.recomputed_tokens.set_function(lambda: runner.recomputed_tokens)
        self.weights = WeightManager(runner.named_weights(), settings.weight_version, settings.weight_sync_timeout_s,
                                     tp_size=settings.tp_size, layout=runner.weight_layout())
        self.metrics.set_version(self.weights.version)
        self.compat = settings.compat
        self.known: dict[str, Req] = {}
        """Requests from arrival to end by rid: what ``/abort_request`` can reach (:meth:`tracked`)."""
        self.gate = PauseGate()
        self.rwlock = RWLock()
        self.pause_cond = asyncio.Lock()  # SGLang's is_pause_cond (module docstring)
        self.session_open = False
        self.renderer = Renderer(tokenizer, spans=self.compat.weight_version_spans,
                                 routes=getattr(runner, "routes", None) is not None)
        self.scheduler = Scheduler(
            runner, StopChecker(tokenizer, self.eos_ids), lambda: self.weights.version,
            settings.max_batch_size, settings.seed, self.metrics.on_step,
            settings.sampling_mask_max_tokens if self.compat.sampling_mask_cap else None,
            prefix_cache=None if settings.disable_radix_cache else PrefixCache(),
        )
        self._pending: list[tuple[Req, int]] = []
        """(request, output index) of the tokens an in_place pause left pending (module docstring)."""
        self.cache_flush = CacheFlush(self.can_flush, self.fully_idle, self.scheduler.drop_cached_prompts)
        self.lora = self._adapter_store(settings, runner)
        self.started_at = time.time()

    @staticmethod
    def _adapter_store(settings: EngineSettings, runner: ModelRunner) -> AdapterStore:
        """The adapters (LoRA off: a store that refuses everything). Rank and targets not
        given are taken from ``lora_paths``' configs, as SGLang infers them."""
        if not settings.lora_on:
            return AdapterStore(None, None, None, None)
        from local_engine.lora_compute import LoraLayers

        configs = [read_adapter_config(lora_path_spec(p)[1]) for p in settings.lora_paths or []]
        rank = settings.max_lora_rank or max(int(c["r"]) for c in configs)
        targets = settings.lora_target_modules or sorted(set().union(*(normalized_targets(c["target_modules"]) for c in configs)))
        layers = LoraLayers(runner.model, targets)
        runner.lora = layers  # timing mode's runner ignores it
        return AdapterStore(layers, rank, targets, settings.max_loaded_loras,
                            incomplete_unloads=settings.compat.sessions)  # 0.5.21+, as sessions

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> Engine:
        """Load the model on ``settings.device`` (checked first: ``cuda`` without a usable GPU
        raises ValueError naming the device, before anything is loaded)."""
        from asyncrl.models import load_config, load_model, load_tokenizer
        from asyncrl.models.cuda_attention import avoid_cudnn_attention
        from local_engine.runner import resolve_device

        device = resolve_device(settings.device)
        avoid_cudnn_attention(device)
        config = load_config(settings.model)
        model = load_model(settings.model, dtype=settings.dtype, seed=settings.seed, device=str(device))
        tokenizer = load_tokenizer(settings.model)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        if settings.timing.enabled:
            from local_engine.simulated import SimulatedRunner

            if settings.enable_return_routed_experts:
                raise ValueError("--enable-return-routed-experts needs a computing engine: timing mode routes nothing")
            weights = {k: v for k, v in model.state_dict(keep_vars=True).items() if v.is_floating_point()}
            vocab = int(model.get_input_embeddings().weight.shape[0])
            call = settings.timing.tool_call
            call_ids = list(tokenizer.encode(call, add_special_tokens=False)) if call else None
            filler = tokenizer.encode("x", add_special_tokens=False)[0]  # plain text, never a special or tool token
            runner = SimulatedRunner(weights, vocab, tokenizer.eos_token_id, settings.timing, settings.seed,
                                     filler_token_id=filler, tool_call_ids=call_ids, model=model)
            return cls(settings, runner, tokenizer, config)
        recorder = None
        if settings.enable_return_routed_experts:
            from local_engine.routes import RouteRecorder

            recorder = RouteRecorder(model)  # a dense model: ValueError, the engine does not start
        return cls(settings, HFModelRunner(model, pad_token_id=pad, routes=recorder), tokenizer, config)

    async def start(self) -> None:
        """Load ``--lora-paths`` (a failure stops the start, as in SGLang), then serve."""
        for spec in self.settings.lora_paths or []:
            name, path = lora_path_spec(spec)
            result = await self.lora.load(name, path, pinned=False)
            if not result["success"]:
                raise ValueError(f"--lora-paths {spec}: {result['error_message']}")
        self.scheduler.start()

    async def close(self) -> None:
        await self.scheduler.close()
        await self.weights.close()

    # -- generation ----------------------------------------------------------------------
    def build_request(self, body: GenerateBody) -> Req:
        """Validate a /generate body into a request; raises BadRequest / Refused (400)."""
        params = self._sampling_params(body.sampling_params)
        if body.input_ids is None and body.text is None:
            raise Refused("Either text, input_ids or input_embeds should be provided.")
        if body.input_ids is not None:  # SGLang takes input_ids when both are given
            ids = list(body.input_ids)
        else:
            ids = list(self.tokenizer.encode(body.text))
        if not ids:
            raise Refused("the input is empty: give a non-empty text or input_ids")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            self.fatal_if_sglang_would_die(f"token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size})")
            raise Refused(f"token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size})")
        if len(ids) + params.max_new_tokens > self.max_model_len:
            raise Refused(
                f"requested token count exceeds the model's maximum context length of {self.max_model_len} tokens: "
                f"{len(ids)} prompt tokens + max_new_tokens {params.max_new_tokens}"
            )
        start = body.routed_experts_start_len  # checked whether or not routes are recorded, as SGLang's scheduler does
        if start < 0:
            raise Refused(f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a non-negative "
                          "routed_experts_start_len.")
        if start > len(ids):
            raise Refused(f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
                          f"len(req.origin_input_ids)={len(ids)}. Please use a smaller routed_experts_start_len.")
        if body.return_logprob and body.logprob_start_len >= len(ids):
            raise Refused(f"logprob_start_len {body.logprob_start_len} must be below the prompt length {len(ids)}")
        if body.lora_path is not None and not self.lora.enabled:
            raise Refused(f"LoRA adapter '{body.lora_path}' was requested, but LoRA is not enabled. Please launch the server "
                          "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.")
        self._check_release_fields(body)
        req = Req(
            rid=body.rid or uuid.uuid4().hex, prompt_ids=ids, params=params, return_logprob=body.return_logprob,
            logprob_start_len=body.logprob_start_len, top_logprobs_num=body.top_logprobs_num,
            return_text_in_logprobs=body.return_text_in_logprobs, stream=body.stream, lora_name=body.lora_path,
            return_sampling_mask=bool(body.return_sampling_mask), sampling_logprobs_mode=body.sampling_logprobs_mode or "selected",
            return_routed_experts=body.return_routed_experts, routed_experts_start_len=start,
        )
        req.seed_sampling(self.settings.enable_deterministic_inference)
        return req

    def fatal_if_sglang_would_die(self, why: str) -> None:
        """``--sglang-fatal-errors``: exit now, answering nothing, as SGLang's server does when
        its scheduler raises on such an input (settings docstring); else return (the caller
        answers 400)."""
        if self.settings.sglang_fatal_errors:
            log.critical("exiting as SGLang's scheduler would (--sglang-fatal-errors): %s", why)
            logging.shutdown()
            os._exit(FATAL_EXIT)

    def _sampling_params(self, raw: dict) -> SamplingParams:
        """``sampling_params`` as SGLang refuses them: an unknown key or a wrong type fails its
        decode (0.5.22+: the contract gate's string error), a value out of range its
        ``SamplingParams.verify`` (a ValueError: ``{"error": {"message": ..}}``)."""
        unknown = sorted(k for k in raw if k not in SamplingParams.model_fields)
        # before 0.5.22 ``SamplingParams(**params)`` raises a TypeError nothing catches: a 500
        decode_error = ContractError if self.compat.contract_gate else InternalError
        if unknown:
            raise decode_error(f"unknown field `{unknown[0]}`, expected one of "
                               + ", ".join(f"`{k}`" for k in SamplingParams.model_fields))
        try:
            return SamplingParams.model_validate(raw)
        except ValidationError as exc:
            message = validation_message(exc)
            if all(e["type"] in RANGE_ERRORS for e in exc.errors()):
                raise Refused(message) from None
            raise decode_error(message) from None

    def _check_release_fields(self, body: GenerateBody) -> None:
        """Fields the emulated release lacks are refused (SGLang would drop them unread)."""
        for name, since, present in (("return_sampling_mask", "0.5.16", self.compat.sampling_mask),
                                     ("sampling_logprobs_mode", "0.5.21", self.compat.sampling_logprobs_mode)):
            if getattr(body, name) and not present:
                raise Refused(f"{name} needs sglang {since}+; this engine emulates sglang {self.compat.version} "
                              "(--sglang-compat), which does not have it")

    @asynccontextmanager
    async def generation_slot(self, req: Req | None = None) -> AsyncIterator[None]:
        """Gate (waits while paused), then the reader lock. The gate is checked again once
        the lock is held: a call that queued behind a weight update while the engine got
        paused goes back to waiting instead of slipping past ``pause(abort)``. Then ``req``'s
        adapter is acquired (SGLang resolves ``lora_path`` after the gate too) and released
        when the slot ends; an adapter it cannot have refuses the request (400)."""
        self.metrics.gate_waiting.inc()
        try:
            while True:
                await self.gate.wait()
                lock = self.rwlock.read()
                await lock.__aenter__()
                if not self.gate.paused:
                    break
                await lock.__aexit__(None, None, None)
        finally:
            self.metrics.gate_waiting.dec()
        try:
            if req is not None and req.lora_name is not None:
                try:
                    req.adapter = await self.lora.acquire(req.lora_name)
                except LoraError as exc:
                    raise Refused(str(exc)) from None
            yield
        finally:
            if req is not None and req.adapter is not None:
                self.lora.release(req.adapter)
            await lock.__aexit__(None, None, None)

    def submit(self, req: Req) -> None:
        if self.scheduler.find(req.rid) is not None:
            raise Refused(f"duplicate request id {req.rid!r}: a request with this rid is in flight")
        req.arrived = time.monotonic()
        self.scheduler.submit(req)

    def render(self, req: Req) -> dict:
        return self.renderer.render(req, self.weights.version)

    async def generate(self, req: Req) -> dict:
        with self.tracked(req):
            async with self.generation_slot(req):
                self.submit(req)
                await req.done.wait()
        self.metrics.finished.labels(reason=(req.finish_reason or {}).get("type", "unknown")).inc()
        return self.render(req)

    def cancel(self, req: Req, message: str) -> None:
        """End one request (its client went away); no-op once finished."""
        self.scheduler.abort_one(req, message)

    @contextmanager
    def tracked(self, req: Req) -> Iterator[None]:
        """``req`` is known to ``/abort_request`` from its arrival to its end, held at the pause
        gate included (SGLang's tokenizer registers its state before the gate)."""
        if req.rid in self.known:
            raise Refused(f"duplicate request id {req.rid!r}: a request with this rid is in flight")
        self.known[req.rid] = req
        try:
            yield
        finally:
            self.known.pop(req.rid, None)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """``/abort_request`` as SGLang's tokenizer and scheduler do it: everything; or an exact
        rid it tracks (others are dropped), passed on once per request from 0.5.20
        (``compat.abort_once``: later ones are dropped, also when the first came while the
        request was held at the pause gate, where the scheduler does not have it yet), which
        the scheduler matches as a prefix of what it holds."""
        if abort_all:
            self.scheduler.abort(abort_all=True)
            return
        req = self.known.get(rid) if rid else None
        if req is None:
            return
        if self.compat.abort_once:
            if req.abort_sent:
                self.metrics.aborts_dropped.inc()
                return
            req.abort_sent = True
        self.scheduler.abort(rid=rid)

    # -- pause ---------------------------------------------------------------------------
    async def pause(self, mode: str) -> None:
        async with self.pause_cond:
            self.gate.close(mode)
            self.metrics.paused.set(1)
            if mode != "abort":
                await self.scheduler.stop_stepping()
                if mode == "retract":
                    self.scheduler.retract_all()
                elif not self.settings.disable_overlap_schedule:
                    self._pending = [(r, len(r.output_ids) - 1) for r in self.scheduler.last_step
                                     if not r.finished and r.output_ids]
                return
            deadline = time.monotonic() + self.settings.pause_drain_timeout_s
            while True:
                self.scheduler.abort(abort_all=True)
                if self.rwlock.readers == 0:
                    return
                if time.monotonic() > deadline:
                    log.warning("pause: %d /generate calls still in flight after %.0f s", self.rwlock.readers,
                                self.settings.pause_drain_timeout_s)
                    return
                await asyncio.sleep(PAUSE_DRAIN_POLL_S)

    async def resume(self) -> None:
        async with self.pause_cond:
            self.gate.open()
            self.metrics.paused.set(0)
            for req, index in self._pending:  # SGLang processes the pending result now, under today's version
                if not req.finished:
                    req.relabel(index, self.weights.version)
            self._pending = []
            self.scheduler.start_stepping()

    async def health_generate(self) -> bool:
        """SGLang's ``/health_generate``: True once the engine shows progress (requests running)
        or generates one token; waits behind a pause; False after ``health_check_timeout_s``."""
        if not self.scheduler.alive:
            return False
        limit = self.settings.health_check_timeout_s
        deadline = time.monotonic() + limit
        try:
            await asyncio.wait_for(self.gate.wait(), limit)
        except TimeoutError:
            return False
        if self.scheduler.running:
            return True
        req = Req(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(self.generate(req), max(0.0, deadline - time.monotonic()))
        except (TimeoutError, Refused):
            self.cancel(req, "health check timed out")
            return False
        return True

    # -- weights -------------------------------------------------------------------------
    @asynccontextmanager
    async def weight_write(self) -> AsyncIterator[None]:
        """Paused: hold the pause condition for the whole update (a continue waits for it).
        Running: the writer lock (waits for in-flight generations)."""
        await self.pause_cond.acquire()
        if self.gate.paused:
            try:
                yield
            finally:
                self.pause_cond.release()
            return
        self.pause_cond.release()
        async with self.rwlock.write():
            yield

    def check_dp(self, route: str) -> None:
        """SGLang asserts on its weight-update routes; a failed assert is an HTTP 500."""
        s = self.settings
        if s.dp_size > 1 and (self.compat.dp_strict or not s.enable_dp_attention):
            raise Refused(f"AssertionError: data-parallel replicas are not supported for {route} (dp_size={s.dp_size})", status=500)

    def check_lora_dp(self) -> None:
        """SGLang asserts ``dp_size == 1`` on its LoRA routes (0.5.17-0.5.21: or dp attention):
        an HTTP 500 (``SglangCompat.lora_dp_attention``). Checked after "LoRA is not enabled"."""
        s = self.settings
        if s.dp_size > 1 and not (self.compat.lora_dp_attention and s.enable_dp_attention):
            why = ("dp_size must be 1 or dp attention must be enabled for dynamic lora loading" if self.compat.lora_dp_attention
                   else "data-parallel replicas are not supported for dynamic lora loading" if self.compat.dp_strict
                   else "dp_size must be 1 for dynamic lora loading")
            raise Refused(f"AssertionError: {why}", status=500)

    def set_version(self, version: str) -> None:
        self.weights.version = version
        self.metrics.set_version(version)

    async def begin_session(self) -> None:
        async with self.weight_write():
            if self.session_open:
                raise WeightUpdateError("a weight-update session is already open; call end_weight_update() first")
            self.session_open = True

    async def end_session(self) -> None:
        async with self.weight_write():
            if not self.session_open:
                raise WeightUpdateError("no weight-update session is open; call begin_weight_update() first")
            self.session_open = False

    def can_flush(self) -> bool:
        """Whether SGLang's ``flush_cache`` would succeed now (module docstring)."""
        queued = 0 if self.compat.flush_ignores_queue_when_paused and self.gate.paused else len(self.scheduler.waiting)
        return not self.scheduler.running and queued == 0

    def fully_idle(self) -> bool:
        """SGLang's ``is_fully_idle()``: nothing running and nothing queued, paused or not."""
        return not self.scheduler.running and not self.scheduler.waiting

    def _flush_after_update(self, flush: bool) -> None:
        """SGLang flushes the cache after an update with ``flush_cache``; with requests still
        running or queued that fails the call (0.5.22+) or kills the engine (older)."""
        if not flush:
            return
        if self.can_flush():
            self.scheduler.drop_cached_prompts()
            return
        if self.compat.soft_flush_failure:
            raise WeightUpdateError("Weights were updated, but the cache was not flushed because requests are still "
                                    "running or queued. Retract or finish them, then call /flush_cache.")
        log.critical("sglang %s asserts here (Cache flush failed after updating weights): the engine stops", self.compat.version)
        self.scheduler.abort(abort_all=True, message="engine crashed: Cache flush failed after updating weights", status=500)
        asyncio.get_running_loop().create_task(self.scheduler.close("engine crashed"))
        raise Refused("AssertionError: Cache flush failed after updating weights", status=500)

    async def update_from_distributed(self, body: UpdateDistributedBody) -> str:
        """Receive one bucket and apply it; raises WeightUpdateError (the model unchanged by it)."""
        self.check_dp("update weights from distributed")
        try:
            if body.abort_all_requests:
                self.scheduler.abort(abort_all=True)
            async with self.weight_write():
                if self.compat.sessions and not self.session_open:
                    raise WeightUpdateError("update_weights_from_distributed must run between begin_weight_update() "
                                            "and end_weight_update()")
                if not self.compat.sessions and body.group_name not in self.weights.groups:
                    # before 0.5.21 the scheduler looks the group up unchecked: a KeyError ends the server
                    self.fatal_if_sglang_would_die(f"update_weights_from_distributed: no weight-update group {body.group_name!r}")
                ranks = self.weights.plan_receive(body, check_alignment=self.compat.align_before_broadcast)
                tensors = await self.weights.receive(ranks, body)
                # off the loop: a big bucket's finiteness check would keep /model_info (the sync
                # agent's liveness probe while members load) from answering
                await asyncio.to_thread(self.weights.validate, body.names, tensors)
                async with self.scheduler.hold():
                    self.weights.apply(body.names, tensors)
                self._flush_after_update(body.flush_cache)
        except WeightUpdateError:
            self.metrics.weight_updates.labels(kind="distributed", result="failed").inc()
            raise
        self.metrics.weight_updates.labels(kind="distributed", result="ok").inc()
        message = "Succeeded to update parameter online."
        if body.weight_version is not None:
            self.set_version(body.weight_version)
        return message

    async def update_from_disk(self, body: UpdateDiskBody) -> str:
        try:
            if body.abort_all_requests:
                self.scheduler.abort(abort_all=True)
            async with self.weight_write():
                tensors = await asyncio.to_thread(self.weights.read_safetensors_dir, body.model_path)
                names = list(tensors)
                staged = [tensors[n] for n in names]
                self.weights.validate(names, staged, full=True)
                async with self.scheduler.hold():
                    self.weights.apply(names, staged)
                self._flush_after_update(body.flush_cache)
        except WeightUpdateError:
            self.metrics.weight_updates.labels(kind="disk", result="failed").inc()
            raise
        self.metrics.weight_updates.labels(kind="disk", result="ok").inc()
        message = "Succeeded to update model weights."
        if body.weight_version is not None:
            self.set_version(body.weight_version)
            message += f" Weight version updated to {body.weight_version}."
        return message
