"""The math answer checker: a table of responses, the fast integer path agreeing with
math-verify, the async path from non-main threads, hard timeouts, and the registry."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollout_service.rewards import (
    MathReward,
    MathRewardConfig,
    RewardRegistry,
    RewardResult,
    VerifyPool,
    default_registry,
    gold_latex,
    score_async,
)

# (response, ground truth, expected score). Expected values are mathematical facts.
TABLE = [
    (r"317 * 29 + 4 = 9197, so \boxed{9197}", "9197", 1.0),
    (r"The answer is \boxed{9,197}.", "9197", 1.0),
    (r"\boxed{ 9197 }", 9197, 1.0),
    (r"\boxed{9196}", "9197", 0.0),
    (r"\boxed{-5}", "-5", 1.0),
    (r"\boxed{5}", "-5", 0.0),
    (r"\boxed{9197.0}", "9197", 1.0),
    (r"\boxed{\text{9197}}", "9197", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
    (r"\boxed{0.75}", r"\frac{3}{4}", 1.0),
    (r"\boxed{\frac{2}{4}}", r"\frac12", 1.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    (r"\boxed{0.5}", "-0.5", 0.0),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),
    (r"\boxed{10^3}", "1000", 1.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    (r"first \boxed{3}, finally \boxed{4}", "4", 1.0),  # only the last box counts
    (r"first \boxed{4}, finally \boxed{3}", "4", 0.0),
    (r"\boxed{4}", ["four", "4"], 1.0),  # any of a list
    ("The answer is 9197.", "9197", 0.0),  # no box
    ("$9197$", "9197", 0.0),
    (r"\boxed{}", "0", 0.0),
    (r"\boxed{9197", "9197", 0.0),  # unbalanced
    ("", "1", 0.0),
]


@pytest.fixture(scope="module")
def pool() -> Iterator[VerifyPool]:
    with VerifyPool(2, timeout_s=5.0) as p:
        p.start()
        yield p


@pytest.fixture(scope="module")
def math(pool: VerifyPool) -> MathReward:
    return MathReward(pool=pool)


@pytest.mark.parametrize(("response", "truth", "expected"), TABLE)
def test_table(math: MathReward, response: str, truth, expected: float) -> None:
    result = math(response, truth, {})
    assert result.score == expected, result.details
    assert result.details["correct"] is (expected == 1.0)
    assert set(result.details) >= {"extracted", "correct", "format_ok", "reason", "timeout", "checked_by"}


def test_fast_integer_path_agrees_with_math_verify(pool: VerifyPool, math: MathReward) -> None:
    slow = MathReward(MathRewardConfig(fast_integer_path=False), pool=pool)
    used_fast = 0
    for response, truth, expected in TABLE:
        a, b = math(response, truth, {}), slow(response, truth, {})
        assert a.score == b.score == expected, (response, a.details, b.details)
        used_fast += a.details["checked_by"] == "fast_int"
        assert b.details["checked_by"] != "fast_int"
    assert used_fast >= 4


def test_details(math: MathReward) -> None:
    d = math(r"so \boxed{\frac{1}{2}}", "0.5", {}).details
    assert (d["extracted"], d["format_ok"], d["answer_source"], d["reason"], d["checked_by"]) == (
        r"\frac{1}{2}", True, "boxed", "ok", "math_verify")
    assert math("no box", "1", {}).details["reason"] == "no_answer"
    assert math(r"\boxed{7", "1", {}).details["reason"] == "unbalanced"
    assert math(r"\boxed{2}", None, {}).details["reason"] == "bad_ground_truth"
    assert math(r"\boxed{2}", "1", {}).details["reason"] == "wrong"
    assert math(None, "1", {}).details["reason"] == "not_text"  # type: ignore[arg-type]


def test_fallback_last_number(pool: VerifyPool) -> None:
    fb = MathReward(MathRewardConfig(fallback_last_number=True), pool=pool)
    r = fb("so it is 9,197.", "9197", {})
    assert r.score == 1.0 and r.details["answer_source"] == "last_number" and r.details["format_ok"] is False
    assert fb("3 then 4.5", "4.5", {}).score == 1.0
    assert fb("no digits here", "1", {}).score == 0.0
    assert fb(r"\boxed{3} but 4", "4", {}).score == 0.0  # a box wins over the fallback


@pytest.mark.parametrize(("truth", "expected"), [
    ("5", [r"\boxed{5}"]), (5, [r"\boxed{5}"]), (2.5, [r"\boxed{2.5}"]), ("$x$", ["$x$"]),
    (["1", 2], [r"\boxed{1}", r"\boxed{2}"]), (None, []), (True, []), ("  ", []), ({"a": 1}, []),
])
def test_gold_latex(truth, expected) -> None:
    assert gold_latex(truth) == expected


def test_async_score_from_a_non_main_thread(math: MathReward) -> None:
    cases = [(r"\boxed{\frac{%d}{4}}" % i, str(i / 4), 1.0) for i in range(12)] + [
        (r"\boxed{\frac{1}{3}}", "0.3", 0.0), (r"\boxed{%d}" % 7, "7", 1.0)]
    out: dict[str, object] = {}

    def runner() -> None:
        async def main() -> list[RewardResult]:
            return await asyncio.gather(*(math.score(r, t, {}) for r, t, _ in cases))
        try:
            out["results"] = asyncio.run(main())
        except BaseException as exc:  # surfaced below
            out["error"] = exc

    thread = threading.Thread(target=runner)
    thread.start()
    thread.join(60)
    assert "error" not in out, out.get("error")
    assert [r.score for r in out["results"]] == [e for _, _, e in cases]


def test_sync_call_from_many_threads(math: MathReward) -> None:
    cases = [(r"\boxed{\frac{%d}{2}}" % i, str(i / 2)) for i in range(16)] + [(r"\boxed{1}", "2")] * 4
    with ThreadPoolExecutor(8) as ex:
        scores = list(ex.map(lambda c: math(c[0], c[1], {}).score, cases))
    assert scores == [1.0] * 16 + [0.0] * 4


async def test_event_loop_is_not_blocked_during_a_slow_check(math: MathReward) -> None:
    """While checks run, the loop keeps running other work. Deterministic, not timed: right
    after the checks start, control is back here with none of them finished (a blocking
    check would have run to its end before yielding), and the loop keeps turning until they
    finish (each turn here is a full pass of the loop while the checks are in flight)."""
    tasks = [asyncio.create_task(math.score(r"\boxed{x^2+2x+1}", "(x+1)^2", {}))]  # symbolic: tens to hundreds of ms
    tasks += [asyncio.create_task(math.score(r"\boxed{\sqrt{%d}}" % i, str(i), {})) for i in range(2, 8)]
    await asyncio.sleep(0)  # each check runs up to its first suspension
    assert not any(t.done() for t in tasks), "a check finished before yielding once: it blocked the event loop"
    turns = 0

    async def until_done() -> None:
        nonlocal turns
        while not all(t.done() for t in tasks):
            turns += 1
            await asyncio.sleep(0)

    await asyncio.wait_for(until_done(), 60)
    results = [t.result() for t in tasks]
    assert results[0].score == 1.0 and all(r.score == 0.0 for r in results[1:])
    assert turns >= 1, "the loop never turned while the checks ran"


def test_hard_timeout_scores_zero_and_the_pool_recovers() -> None:
    # soft_timeout_s=0: only the wall-clock kill can stop the check.
    with VerifyPool(1, timeout_s=0.5, soft_timeout_s=0) as pool:
        pool.start()
        slow = MathReward(pool=pool)
        t0 = time.perf_counter()
        r = slow(r"\boxed{9^{9^{9^{9}}}}", "1", {})
        took = time.perf_counter() - t0
        assert r.score == 0.0 and r.details["timeout"] is True and r.details["reason"] == "timeout"
        assert 0.5 <= took < 3.0
        assert pool.restarts == 1
        ok = slow(r"\boxed{\frac{1}{2}}", "0.5", {})  # waits for the replacement worker
        assert ok.score == 1.0 and ok.details["timeout"] is False


async def test_async_timeout_does_not_hang() -> None:
    with VerifyPool(1, timeout_s=0.5, soft_timeout_s=0) as pool:
        reward = MathReward(pool=pool)
        r = await asyncio.wait_for(reward.score(r"\boxed{9^{9^{9^{9}}}}", "1", {}), timeout=30)
        assert r.details["reason"] == "timeout" and r.score == 0.0


def test_closed_pool_returns_error_not_raise() -> None:
    pool = VerifyPool(1, timeout_s=1.0)
    pool.close()
    r = MathReward(pool=pool)(r"\boxed{\frac{1}{2}}", "0.5", {})
    assert r.score == 0.0 and r.details["reason"] == "error"


# -- registry ----------------------------------------------------------------------------


def const(value: float):
    return lambda response, truth, extra: RewardResult(value, {"which": str(value)})


def test_registry_exact_then_glob_in_order_then_default() -> None:
    reg = RewardRegistry(default=const(9.0))
    reg.register("a/b", const(1.0))
    reg.register("a/*", const(2.0))
    reg.register("a/b*", const(3.0))  # registered later than a/*: never reached for a/bc
    reg.register("x?", const(4.0))
    assert reg("a/b", "", None).score == 1.0
    assert reg("a/bc", "", None).score == 2.0
    assert reg("xy", "", None).score == 4.0
    assert reg("other", "", None).score == 9.0
    assert "other" in reg
    with pytest.raises(ValueError, match="already"):
        reg.register("a/b", const(5.0))
    reg.register("a/b", const(5.0), replace=True)
    assert reg("a/b", "", None).score == 5.0
    bare = RewardRegistry()
    assert "a" not in bare
    with pytest.raises(LookupError):
        bare.resolve("a")
    assert RewardRegistry().__dict__ is not bare.__dict__  # per instance, nothing global


async def test_registry_turns_exceptions_into_zero() -> None:
    def boom(response, truth, extra):
        raise RuntimeError("bad sample")

    reg = RewardRegistry(default=boom)
    r = reg("any", "x", "y", {})
    assert r.score == 0.0 and "RuntimeError" in r.details["error"]
    r = await reg.score("any", "x", "y", {})
    assert r.score == 0.0 and "bad sample" in r.details["error"]
    r = await score_async(lambda *a: "not a result", "x", "y", {})
    assert r.score == 0.0 and "TypeError" in r.details["error"]


async def test_default_registry_scores_the_demo_task(math: MathReward) -> None:
    reg = default_registry(math)
    assert reg.resolve("asyncrl/arith") is math
    assert (await reg.score("asyncrl/arith", r"<tool_call>{}</tool_call> \boxed{9197}", "9197", {})).score == 1.0
    assert reg.resolve("some/math") is math
    with pytest.raises(LookupError):
        default_registry(math, math_default=False).resolve("some/math")
    combined = default_registry(math, format_weight=0.1).resolve("asyncrl/arith")
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> \\boxed{2}'
    assert combined(good, "2", {}).score == pytest.approx(1.1)
    assert combined(r"\boxed{2}", "2", {}).score == pytest.approx(1.0)  # no tool call: no format bonus


def test_reward_result_validation() -> None:
    r = RewardResult(1, {"n": 3, "ok": True, "s": "x", "f": 0.5})
    assert r.score == 1.0 and r.details == {"n": 3.0, "ok": True, "s": "x", "f": 0.5}
    assert isinstance(r.details["n"], float)
    with pytest.raises(ValueError):
        RewardResult(float("nan"))
    with pytest.raises(TypeError):
        RewardResult(0.0, {"bad": [1]})
