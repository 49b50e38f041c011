"""The sync transaction and ``sync.pause_policy`` on real SGLang (issue 45 item 3), the same
sequence run against local_engine (``--sglang-compat 0.5.23``) and a real SGLang 0.5.23 server,
so that what SGLang does differently shows here and is fixed in local_engine.

Each run: the rollout service and the sync agent (the product's own) in front of one engine
behind a recording proxy; a long generation is started through the rollout's engine pool and
held mid-way deterministically with SGLang's own test hook, ``/slow_down`` (every forward
sleeps; local_engine serves the same route), until the sync's ``/pause_generation`` has
reached the engine; then the engine runs at full speed again. Checked: the engine calls of the
transaction in order (pause, begin, group, update, end, flush as the policy says, continue),
the sync succeeded, and the generation met in flight is treated as its policy says — aborted
with its partial output (abort), or finished with its tokens labelled old then new weights in
spans (retract, in_place).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.helpers.processes import start_engine
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.reference_model import in_place_logprobs, teacher_forced_logprobs
from tests.helpers.waiting import WAIT_S, wait_for
from tests.sglang.conftest import ADMIN_KEY, API_KEY, DEMO_MODEL, SLICE
from tests.sglang_cpu.server import start_sglang
from tests.sync.conftest import IN_PLACE_SAFE, perturbed_weights, publisher, stack

PROMPT = [5, 17, 42, 99, 7, 300, 12]
LONG = 600  # tokens of the held generation (the servers' context is 1024)
SLOW_S = 0.25  # each forward's sleep while held: 600 tokens would take 150 s, the sync needs a few
CALL_S = 300.0
CLOSE = 1e-4  # an engine's log-prob against a teacher-forced float32 forward of the same weights
SYNC_ORDER = ("/pause_generation", "/begin_weight_update", "/init_weights_update_group",
              "/update_weights_from_distributed", "/end_weight_update", "/continue_generation")


@contextlib.contextmanager
def one_engine(kind: str, release: str, tmp_path, *flags: str):
    """One engine serving the demo model with the test keys; ``flags``: SGLang launch flags both
    kinds take (``--disable-radix-cache``, ``--disable-overlap-schedule``)."""
    if kind == "local":
        with start_engine(tmp_path, "--sglang-compat", release, "--max-model-len", "1024", "--weight-sync-timeout-s", "60",
                          *flags, model=str(DEMO_MODEL), api_key=API_KEY, admin_api_key=ADMIN_KEY,
                          name=f"local-{release}") as e:
            yield e
    else:
        with start_sglang(tmp_path, DEMO_MODEL, *flags, release=release, api_key=API_KEY, admin_api_key=ADMIN_KEY,
                          name=f"sglang-{release}") as e:
            yield e


def demo_models(weights: dict | None = None):
    """The demo model as the engines serve it (its own config), with ``weights`` if given."""
    from asyncrl.models import load_model

    model = load_model(str(DEMO_MODEL), dtype="float32")
    if weights is not None:
        model.load_state_dict(weights)
    return model.eval()


async def slow_down(engine, seconds: float | None) -> None:
    async with engine.client() as c:
        await c._call("POST", "/slow_down", {"forward_sleep_time": seconds}, admin=True)


async def tokens_in_flight(engine) -> int:
    async with engine.client() as c:
        return sum(load.get("num_total_tokens", 0) for load in (await c.loads())["loads"])


async def run_policy(tmp_path, nats_url, engine, policy: str):
    """The held generation's result and what the proxy saw (module docstring)."""
    proxy = await RecordingProxy(engine.url).start()
    extra = ("async_training.partial_rollout=true", "rollout.total_rollout_steps=1", "rollout.n=1",
             f"sync.pause_policy={policy}", f"model.path={DEMO_MODEL}", f"engines.api_key={API_KEY}",
             f"engines.admin_api_key={ADMIN_KEY}")
    try:
        async with stack(tmp_path, nats_url, [proxy.url], *extra) as (svc, _rollout_url, agent, agent_url, cfg):
            await wait_for(lambda: svc.runner.snapshot().active == 0 and svc.runner.counters.trajectories_finished >= 1,
                           CALL_S, "the service's own sample to finish")
            await slow_down(engine, SLOW_S)
            rid = f"{svc.runner.rid_prefix}policy-{policy}"
            call = asyncio.create_task(svc.pool.generate(None, PROMPT, {"max_new_tokens": LONG, "temperature": 0.0,
                                                                        "ignore_eos": True}, rid))
            await wait_for(lambda: _decoded(engine, len(PROMPT) + 3), WAIT_S * 4, "the long generation to decode")
            pub = publisher(agent_url, cfg, bucket_bytes=1 << 20)
            try:
                _, weights = perturbed_weights(3)
                sync = asyncio.create_task(pub.publish(1, weights))
                await wait_for(lambda: any(p == "/pause_generation" for _, p, _, _ in proxy.requests) or sync.done(),
                               CALL_S, "the sync's pause to reach the engine")
                await slow_down(engine, None)  # released only once the pause has reached the engine
                await sync
                rec = agent.coordinator.records[-1]
                await wait_for(lambda: rec.done, 60, "the sync to finish")
                assert rec.state == "succeeded", rec.error
            finally:
                await pub.close()
            res = await asyncio.wait_for(call, CALL_S)
            assert not svc.runner.paused and svc.runner.version == 1
    finally:
        await slow_down(engine, None)
        await proxy.stop()
    return res, [(path, body) for _, path, _, body in proxy.requests]


async def _decoded(engine, over: int) -> bool:
    return await tokens_in_flight(engine) > over


def _order(calls: list[tuple[str, object]]) -> list[str]:
    """The transaction's engine calls, in order, each once (repeats and other calls dropped)."""
    seen: list[str] = []
    for path, _ in calls:
        if path in SYNC_ORDER and path not in seen:
            seen.append(path)
    return seen


def _expected_order(release: str) -> list[str]:
    """SYNC_ORDER; before 0.5.21 there is no begin/end weight session."""
    sessions = tuple(map(int, release.split("."))) >= (0, 5, 21)
    return [p for p in SYNC_ORDER if sessions or p not in ("/begin_weight_update", "/end_weight_update")]


# retract and in_place keep a request across the sync: refused before 0.5.19 (no spans) and,
# for retract, before 0.5.21 (tests/sync/test_layout.py); abort runs on every release
CASES = [pytest.param(kind, "0.5.23", policy, marks=[getattr(pytest.mark, SLICE)] if policy == "abort" else [],
                      id=f"{policy}-{kind}-0.5.23") for policy in ("abort", "retract", "in_place") for kind in ("local", "sglang")]
CASES += [pytest.param(kind, "0.5.18", "abort", id=f"abort-{kind}-0.5.18") for kind in ("local", "sglang")]


@pytest.mark.parametrize(("kind", "release", "policy"), CASES)
async def test_a_sync_meets_a_generation_in_flight(tmp_path, nats_server, kind, release, policy):
    """Also where the boundary falls (issue 66 W2), token by token: before it the old weights'
    log-probs (teacher-forced), after it the new weights' — over the whole context re-prefilled
    (retract, flushed on 0.5.23), or over the old weights' KV (in_place, on engines without
    prefix cache and overlap, as the agent requires)."""
    flags = IN_PLACE_SAFE if policy == "in_place" else ()
    with one_engine(kind, release, tmp_path, *flags) as engine:
        res, calls = await run_policy(tmp_path, nats_server.url, engine, policy)
    assert _order(calls) == _expected_order(release), _order(calls)
    pauses = [body for path, body in calls if path == "/pause_generation"]
    flushes = [path for path, _ in calls if path == "/flush_cache"]
    assert pauses == [{"mode": policy}]
    spans = [(s.version, s.start, s.end) for s in res.weight_versions]
    if policy == "abort":
        # aborted by the engine's pause: partial output, every token from the old weights; the
        # rollout's agent would resend prompt + these tokens (re-prefilled) after the sync
        assert res.finish_reason.type == "abort" and 0 < len(res.output_ids) < LONG and len(spans) <= 1
        assert flushes, "abort flushes the prefix cache"
        return
    # retract / in_place: never aborted, finished after the sync with the new weights' tail
    assert res.finish_reason.type == "length" and len(res.output_ids) == LONG
    assert len(spans) == 2 and spans[0][0] != 1 and spans[1][0] == 1 and spans[1][2] == LONG, spans
    assert res.meta_info["num_retractions"] == (1 if policy == "retract" else 0)
    old, new = demo_models(), demo_models(perturbed_weights(3)[1])
    k, out = spans[0][2], res.output_ids
    assert 2 <= k < LONG - 16
    before = teacher_forced_logprobs(old, PROMPT, out[:k])
    assert max(abs(a - b) for a, b in zip(res.logprobs[:k], before, strict=True)) < CLOSE, "the old span: the old weights'"
    checked = out[:k + 16]
    after = (teacher_forced_logprobs(new, PROMPT, checked)[k:] if policy == "retract"
             else in_place_logprobs(old, new, PROMPT, checked, k))
    gaps = [abs(a - b) for a, b in zip(res.logprobs[k:k + 16], after, strict=True)]
    assert max(gaps) < CLOSE, f"the new span is not {policy}'s new weights: gaps {gaps[:4]}..."
    assert flushes == (["/flush_cache"] if policy == "retract" else []), "in_place never flushes; retract tries once"

