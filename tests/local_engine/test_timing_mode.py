"""Timing mode: no model compute, per-step latency and long-tailed lengths, real protocol."""

from __future__ import annotations

import asyncio
import statistics
import time

from asyncrl.engine_client import EngineClient
from local_engine.simulated import CALCULATOR_CALL as CALL
from tests.helpers.processes import start_engine


async def test_timing_mode_lengths_latency_and_batching(tmp_path):
    with start_engine(tmp_path, "--timing-mode", "--timing-decode-ms", "10", "--timing-length-median", "40",
                      "--timing-length-sigma", "0.8", "--timing-length-max", "300") as engine:
        async with EngineClient(engine.url) as c:
            t0 = time.monotonic()
            one = await c.generate([1, 2, 3], {"max_new_tokens": 1000})
            single = time.monotonic() - t0
            assert one.finish_reason.type == "stop" and 1 <= len(one.output_ids) <= 300
            assert single >= len(one.output_ids) * 0.010 * 0.9, "each decode step takes its latency"
            t0 = time.monotonic()
            many = await asyncio.gather(*(c.generate([1, 2, 3], {"max_new_tokens": 1000}) for _ in range(24)))
            batched = time.monotonic() - t0
            lengths = [len(r.output_ids) for r in many]
            assert max(lengths) <= 300 and len(set(lengths)) > 5, "lengths are drawn, not fixed"
            assert max(lengths) > 2 * statistics.median(lengths), "a long tail"
            # batched decoding: 24 rows take about as long as the longest one, not the sum
            assert batched < sum(lengths) * 0.010 * 0.5
            info = await c.model_info()
            assert info["weight_version"] == "default"


async def test_an_interrupted_request_keeps_its_length_under_every_pause_mode(tmp_path):
    """Timing mode remembers the length a request drew: aborted and resent (prompt + kept
    tokens), retracted and re-prefilled, or paused in place, it ends at the same total length
    as uninterrupted, and the re-prefilled context is counted as recomputed."""
    import aiohttp

    from tests.helpers.waiting import WAIT_S, wait_for

    prompt = [11, 12, 13, 14]
    sp = {"max_new_tokens": 1000, "temperature": 0}
    with start_engine(tmp_path, "--timing-mode", "--timing-decode-ms", "5", "--timing-prefill-ms-per-token", "0",
                      "--timing-length-median", "300", "--timing-length-sigma", "0", "--timing-length-max", "600") as engine:
        async with EngineClient(engine.url) as c:
            async def recomputed() -> float:
                async with aiohttp.ClientSession() as s, s.get(f"{engine.url}/metrics") as r:
                    line = next(x for x in (await r.text()).splitlines() if x.startswith("local_engine_recomputed_prefill_tokens "))
                    return float(line.split()[1])

            async def decoding() -> bool:
                return (await c.loads())["loads"][0]["num_total_tokens"] > len(prompt) + 20

            at_start = await recomputed()  # the readiness probes' one-token generations may have been cut and resent
            whole = await c.generate(prompt, sp)
            assert len(whole.output_ids) == 300 and await recomputed() == at_start  # sigma 0: every draw is the median
            for mode in ("abort", "retract", "in_place"):
                call = asyncio.create_task(c.generate(prompt, sp))
                await wait_for(decoding, WAIT_S, "tokens before the pause")
                before = await recomputed()
                await c.pause(mode)
                await c.resume()
                first = await asyncio.wait_for(call, 60)
                if mode == "abort":  # the resend, as the rollout service does it
                    assert first.finish_reason.type == "abort"
                    rest = await c.generate(prompt + first.output_ids, {**sp, "max_new_tokens": 1000 - len(first.output_ids)})
                    total, context = len(first.output_ids) + len(rest.output_ids), len(prompt) + len(first.output_ids)
                else:
                    total, context = len(first.output_ids), None
                assert total == 300, mode
                grew = await recomputed() - before
                if mode == "in_place":
                    assert grew == 0
                elif mode == "retract":
                    assert first.meta_info["num_retractions"] == 1 and grew > len(prompt) + 20
                else:
                    assert grew == context


async def test_tool_turns_end_responses_with_the_tool_call_until_the_context_has_enough(tmp_path):
    """``timing.tool_call``/``tool_turns``: a response ends with the call's tokens while its
    context holds fewer than ``tool_turns`` copies; then responses are filler only."""
    from asyncrl.models import load_tokenizer

    tok = load_tokenizer("builtin:tiny")
    call = tok.encode(CALL, add_special_tokens=False)
    assert tok.decode(call) == CALL, "the builtin tokenizer round-trips the call"
    with start_engine(tmp_path, "--timing-mode", "--timing-decode-ms", "1", "--timing-length-median", "5",
                      "--timing-length-sigma", "0", "--timing-tool-call", CALL, "--timing-tool-turns", "2") as engine:
        async with EngineClient(engine.url) as c:
            sp = {"max_new_tokens": 1000, "temperature": 0}
            context = [1, 2, 3]
            for turn in range(3):
                out = await c.generate(context, sp)
                ids = out.output_ids
                assert ids[-1] == tok.eos_token_id, "output_ids keep the end of sequence"
                assert (ids[-1 - len(call):-1] == call) == (turn < 2), (turn, ids)
                context = context + ids + [4, 5]  # the "tool result"
            assert len(ids) == 5, "the last turn is the drawn length (sigma 0: the median) of filler"
            assert tok.decode(ids[:-1]) == "xxxx", "the filler is plain text: an agent reads content, not markup"
