"""Issue 66 N1 and N2: the two ways a sync that flushes nothing (``in_place``) mislabels tokens on
SGLang, reproduced by local_engine with SGLang's defaults and gone under the two flags the sync
agent requires for ``in_place`` (``--disable-radix-cache --disable-overlap-schedule``).

- N2 (overlap): the token of the step before an in_place pause is still pending at the pause, so
  an update meanwhile labels it with the new version, though the old weights sampled it.
- N1 (radix cache): a request aborted while running leaves its KV in the cache; its resend after
  the update (prompt + kept tokens, as per_request's "resume" does) is prefilled over that
  old-weight KV (``cached_tokens``), so its tokens are not the new policy's.

Compared, token by token: the engine's log-probs against teacher-forced old and new weights."""

from __future__ import annotations

import asyncio
import copy

import pytest

from asyncrl import failpoints
from tests.helpers.reference_model import teacher_forced_logprobs
from tests.helpers.waiting import WAIT_S, wait_for
from tests.local_engine.helpers import running_tokens
from tests.local_engine.weight_trainer import perturb

PROMPT = [9, 10, 11, 12, 13]
STEP = "local_engine.step"
GREEDY = {"temperature": 0, "ignore_eos": True}
SAFE = ("--disable-radix-cache", "--disable-overlap-schedule")
CLOSE, APART = 1e-4, 1e-3


async def _paused(engine) -> bool:
    async with engine.client() as c:
        return (await c.server_info())["internal_states"][0]["paused"]


async def _hold_then_pause(engine, client, points) -> None:
    """Pause in place while a step is held, so the pause always meets the generation running."""
    (points / f"{STEP}.arm").touch()
    try:
        await wait_for(lambda: bool(failpoints.reached(points, STEP)), WAIT_S, "the engine to hold the generation")
        pause = asyncio.create_task(client.pause("in_place"))
        await wait_for(lambda: _paused(engine), WAIT_S, "the pause to reach the engine")
    finally:
        (points / f"{STEP}.arm").unlink()
        (points / f"{STEP}.release").touch()
    await pause
    for f in points.iterdir():
        f.unlink()


async def _over(client, n: int) -> bool:
    return await running_tokens(client) >= n


@pytest.mark.parametrize("flags", [(), SAFE], ids=["sglang-defaults", "in-place-safe"])
async def test_an_in_place_sync_labels_and_reuses_as_sglang_does(ref_model, tmp_path, flags):
    from tests.helpers.processes import start_engine

    points = tmp_path / "failpoints"
    points.mkdir()
    new = perturb(copy.deepcopy(ref_model), 41)
    new.save_pretrained(tmp_path / "new")
    with start_engine(tmp_path, *flags, env={failpoints.ENV_DIR: str(points)}, name="engine") as engine:
        async with engine.client() as c:
            info = await c.server_info()
            assert (info["disable_radix_cache"], info["disable_overlap_schedule"]) == ((True, True) if flags else (False, False))
            kept = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 400, **GREEDY}, rid="kept"))
            resumed = asyncio.create_task(c.generate(PROMPT[::-1], {"max_new_tokens": 400, **GREEDY}, rid="resumed"))
            await wait_for(lambda: _over(c, 2 * len(PROMPT) + 16), WAIT_S, "both to decode")
            await c.abort("resumed")  # per_request's "resume": aborted by its exact rid, tokens kept
            partial = await asyncio.wait_for(resumed, 60)
            assert partial.finish_reason.type == "abort" and len(partial.output_ids) >= 4
            await _hold_then_pause(engine, c, points)
            try:
                await c.update_weights_from_disk(str(tmp_path / "new"), weight_version=7, flush_cache=False)
            finally:
                await c.resume()
            done = await asyncio.wait_for(kept, 120)
            context = PROMPT[::-1] + partial.output_ids
            resent = await c.generate(context, {"max_new_tokens": 8, **GREEDY})
    # N2: where the spans put the boundary, against the weights that really sampled each token
    k = done.weight_versions[0].end
    assert [s.version for s in done.weight_versions] == [0, 7] and 4 <= k < 400
    old = teacher_forced_logprobs(ref_model, PROMPT, done.output_ids[:k + 1])
    assert abs(done.logprobs[k - 1] - old[k - 1]) < CLOSE  # the last token labelled old: the old weights'
    first_new_is_old = abs(done.logprobs[k] - old[k]) < CLOSE
    assert first_new_is_old == (not flags), (f"token {k}, labelled 7: log-prob {done.logprobs[k]:.6f}, the old weights' "
                                             f"{old[k]:.6f} ({'overlap on' if not flags else 'overlap off'})")
    # N1: the resend's KV, against the new weights over the whole context
    exact = teacher_forced_logprobs(new, context, resent.output_ids)
    gap = max(abs(a - b) for a, b in zip(resent.logprobs, exact, strict=True))
    if flags:
        assert resent.cached_tokens == 0 and gap < CLOSE, (resent.cached_tokens, gap)
    else:
        assert resent.cached_tokens == len(context) - 1, "the resend took its context's KV from the aborted request"
        assert gap > APART, "decoded over old-weight KV: not the new policy's log-probs"
