"""Issue 66 N1 and N2 on SGLang 0.5.23's own scheduler (overlap on, as by default), and the same
sequence on local_engine (``--sglang-compat 0.5.23``), which must behave alike: an ``in_place``
update meets two generations, one kept at the engine and one aborted by its exact rid and
resent afterwards (per_request's "resume"). Compared token by token against teacher-forced
float32 forwards of the old and new weights:

- N2: with the overlap scheduler the first token labelled with the new version is the one the
  old weights sampled before the pause (its log-prob is the old weights'); without it, the new
  weights computed it.
- N1: with the radix cache the resend takes its whole context but the last token from the KV
  the aborted call left (``cached_tokens``), so its log-probs are not the new weights'; without
  it, nothing is cached and they are.

And what the product reads from the engine: ``/server_info`` reports both switches, and the sync
agent's rule (``policy_problems``) refuses in_place on the defaults, naming both flags, and
accepts the engine started with them."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.sync_control.layout import EngineLayout
from asyncrl.sync_control.pause_policy import pause_plan, policy_problems
from tests.helpers.reference_model import teacher_forced_logprobs
from tests.helpers.waiting import WAIT_S, wait_for
from tests.sglang.test_sync_policies import (
    CALL_S,
    CLOSE,
    SLOW_S,
    demo_models,
    one_engine,
    slow_down,
    tokens_in_flight,
)
from tests.sync.conftest import IN_PLACE_SAFE, perturbed_weights

PROMPT = [5, 17, 42, 99, 7, 300, 12]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
APART = 1e-3


async def _decoded(engine, over: int) -> bool:
    return await tokens_in_flight(engine) > over


@pytest.mark.parametrize("flags", [(), IN_PLACE_SAFE], ids=["defaults", "in-place-safe"])
@pytest.mark.parametrize("kind", ["local", "sglang"])
async def test_an_in_place_update_labels_and_reuses_kv_as_the_flags_say(tmp_path, kind, flags):
    new_weights = perturbed_weights(3)[1]
    demo_models(new_weights).save_pretrained(tmp_path / "new")
    with one_engine(kind, "0.5.23", tmp_path, *flags) as engine:
        async with engine.client() as c:
            info = await c.server_info()
            assert (info["disable_radix_cache"], info["disable_overlap_schedule"]) == ((True, True) if flags else (False, False))
            found = policy_problems(pause_plan("in_place", True), [EngineLayout.from_server_info(engine.url, info)])
            assert ([f for f in ("--disable-radix-cache", "--disable-overlap-schedule") if any(f in p for p in found)]
                    == ([] if flags else ["--disable-radix-cache", "--disable-overlap-schedule"])), found
            await slow_down(engine, SLOW_S)
            try:
                kept = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 200, **GREEDY}, rid="hazard-kept"))
                resumed = asyncio.create_task(c.generate(PROMPT[::-1], {"max_new_tokens": 200, **GREEDY}, rid="hazard-resumed"))
                await wait_for(lambda: _decoded(engine, 2 * len(PROMPT) + 8), WAIT_S * 4, "both to decode")
                await c.abort("hazard-resumed")
                partial = await asyncio.wait_for(resumed, CALL_S)
                assert partial.finish_reason.type == "abort" and len(partial.output_ids) >= 2
                await c.pause("in_place")
                try:
                    await c.update_weights_from_disk(str(tmp_path / "new"), weight_version=7, flush_cache=False)
                finally:
                    await slow_down(engine, None)
                    await c.resume()
            finally:
                await slow_down(engine, None)
            done = await asyncio.wait_for(kept, CALL_S)
            context = PROMPT[::-1] + partial.output_ids
            resent = await c.generate(context, {"max_new_tokens": 8, **GREEDY})
    old, new = demo_models(), demo_models(new_weights)
    k = done.weight_versions[0].end
    assert [s.version for s in done.weight_versions] == [0, 7] and 2 <= k < 200, done.weight_versions
    before = teacher_forced_logprobs(old, PROMPT, done.output_ids[:k + 1])
    assert abs(done.logprobs[k - 1] - before[k - 1]) < CLOSE, "the last token labelled old: the old weights'"
    first_new_is_old = abs(done.logprobs[k] - before[k]) < CLOSE
    assert first_new_is_old == (not flags), (f"{kind}: token {k}, labelled 7, log-prob {done.logprobs[k]:.6f}; the old "
                                             f"weights' {before[k]:.6f} (overlap {'off' if flags else 'on'})")
    exact = teacher_forced_logprobs(new, context, resent.output_ids)
    gap = max(abs(a - b) for a, b in zip(resent.logprobs, exact, strict=True))
    if flags:
        assert resent.cached_tokens == 0 and gap < CLOSE, (kind, resent.cached_tokens, gap)
    else:
        assert resent.cached_tokens == len(context) - 1, (kind, resent.cached_tokens, len(context))
        assert gap > APART, f"{kind}: decoded over the old weights' KV, yet the new weights' log-probs ({gap:.2e})"
