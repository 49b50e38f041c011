"""RELIABILITY B6: hostile model output scores 0 quickly, has no side effects, and cannot
change the scores of later samples."""

from __future__ import annotations

import asyncio
import io
import time
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_service.rewards import (
    CombinedReward,
    FormatConfig,
    FormatReward,
    MathReward,
    MathRewardConfig,
    VerifyPool,
)

REWARDS_SRC = Path(__file__).resolve().parents[2] / "rollout_service" / "rewards"
TIMEOUT_S = 2.0

# Reference samples scored before and after the hostile ones: their scores must not change.
REFERENCE = [
    (r"\boxed{9197}", "9197"), (r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{\sqrt{8}}", r"2\sqrt{2}"),
    (r"\boxed{3}", "4"), (r"\boxed{x+1}", "1+x"), ("no answer", "1"),
]


def hostile_inputs(marker: Path) -> dict[str, str]:
    m = str(marker)
    return {
        "os_system_plain": f"__import__('os').system('touch {m}')",
        "os_system_boxed": f'\\boxed{{__import__("os").system("touch {m}")}}',
        "eval_boxed": f"\\boxed{{eval(\"open('{m}', 'w')\")}}",
        "exec_boxed": f"\\boxed{{exec(\"open('{m}', 'w').write('x')\")}}",
        "dunder_boxed": r"\boxed{().__class__.__bases__[0].__subclasses__()}",
        "lambda_boxed": r"\boxed{(lambda: __import__('os').system('touch " + m + r"'))()}",
        "python_fstring": f"\\boxed{{f'{{open(\"{m}\", \"w\")}}'}}",
        "huge_latex": r"\boxed{" + r"\frac{1}{2}+" * 20_000 + "1}",
        "deep_braces": r"\boxed{" + "{" * 50_000 + "1" + "}" * 50_000 + "}",
        "only_open_braces": r"\boxed{" + "{" * 1_000_000,
        "one_megabyte": ("lorem ipsum 12345 " * 60_000)[:1_000_000] + r" \boxed{7}",
        "megabyte_of_boxes": r"\boxed{1}" * 100_000,
        "power_tower": r"\boxed{9^{9^{9^{9}}}}",
        "big_power": r"\boxed{10^{10^{10}}}",
        "factorial": r"\boxed{(10^{6})!}",
        "huge_integer": r"\boxed{" + "9" * 500 + "}",
        "nul_and_surrogates": "\x00\ud800\\boxed{\x00\ud800}",
        "tool_call_bomb": "<tool_call>" + "[" * 100_000 + "</tool_call>" + r"\boxed{1}",
        "many_tool_calls": '<tool_call>{"name": "x", "arguments": {}}</tool_call>' * 20_000,
    }


@pytest.fixture(scope="module")
def pool() -> Iterator[VerifyPool]:
    with VerifyPool(2, timeout_s=TIMEOUT_S) as p:
        p.start()
        yield p


@pytest.fixture(scope="module")
def rewards(pool: VerifyPool) -> dict[str, object]:
    math = MathReward(MathRewardConfig(timeout_s=TIMEOUT_S), pool=pool)
    fallback = MathReward(MathRewardConfig(timeout_s=TIMEOUT_S, fallback_last_number=True), pool=pool)
    fmt = FormatReward(FormatConfig(check_tool_calls=True, min_tool_calls=1))
    return {"math": math, "fallback": fallback, "format": fmt, "combined": CombinedReward(math, fmt, format_weight=0.5)}


def reference_scores(math: MathReward) -> list[float]:
    return [math(r, t, {}).score for r, t in REFERENCE]


@pytest.mark.parametrize("name", sorted(hostile_inputs(Path("/x"))))
def test_hostile_input_scores_zero_fast_without_side_effects(
    rewards: dict, tmp_path: Path, name: str
) -> None:
    marker = tmp_path / "pwned"
    text = hostile_inputs(marker)[name]
    kinds = ["math"] if "\\boxed{" in text else ["math", "fallback"]  # the fallback only acts without a box
    for kind in kinds:
        t0 = time.perf_counter()
        r = rewards[kind](text, "2", {})
        took = time.perf_counter() - t0
        assert r.score == 0.0 and r.details["correct"] is False, (kind, r.details)
        # Bounded by the wall-clock timeout plus slack for a worker restart on 2 busy cores.
        assert took < TIMEOUT_S + 3.0, (kind, took, r.details)
    assert rewards["format"](text, "2", {}).score == 0.0
    assert not marker.exists()


def test_prefiltered_inputs_never_reach_the_worker(rewards: dict, tmp_path: Path) -> None:
    hostile = hostile_inputs(tmp_path / "m")
    for name, reason in [("huge_latex", "too_long"), ("deep_braces", "too_deep"),
                         ("only_open_braces", "too_deep"), ("huge_integer", "wrong")]:
        t0 = time.perf_counter()
        r = rewards["math"](hostile[name], "1", {})
        assert r.details["reason"] == reason and time.perf_counter() - t0 < 0.25, (name, r.details)
        assert r.details["checked_by"] in ("none", "fast_int")


def test_a_box_of_ones_is_still_judged_on_the_last_box(rewards: dict, tmp_path: Path) -> None:
    text = hostile_inputs(tmp_path / "m")["megabyte_of_boxes"]
    assert rewards["math"](text, "1", {}).score == 1.0  # correct answer, terrible format
    assert rewards["combined"](text, "1", {}).details["format_ok"] is False


def test_bad_samples_do_not_change_later_scores(rewards: dict, pool: VerifyPool, tmp_path: Path) -> None:
    math = rewards["math"]
    before = reference_scores(math)
    assert before == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    hostile = hostile_inputs(tmp_path / "m")
    for name in ("power_tower", "os_system_boxed", "factorial", "nul_and_surrogates"):
        r = math(hostile[name], "1", {})
        assert r.score == 0.0
        if name == "power_tower":  # stopped by math-verify's in-worker timeout or by the kill
            assert r.details["reason"] == "timeout" and r.details["timeout"] is True
        assert reference_scores(math) == before, name
    assert not (tmp_path / "m").exists()


async def test_concurrent_mix_of_bad_and_good_samples(rewards: dict, tmp_path: Path) -> None:
    math = rewards["math"]
    hostile = hostile_inputs(tmp_path / "m")
    batch = [(r, t) for r, t in REFERENCE] + [(hostile[n], "1") for n in ("power_tower", "big_power", "eval_boxed", "one_megabyte")]
    batch += [(r, t) for r, t in REFERENCE]
    results = await asyncio.wait_for(asyncio.gather(*(math.score(r, t, {}) for r, t in batch)), timeout=60)
    scores = [r.score for r in results]
    assert scores == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0] + [0.0] * 4 + [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    combined = await rewards["combined"].score(hostile["one_megabyte"], "7", {})  # scanned off the loop
    assert combined.details["correct"] is True and combined.details["format_ok"] is False
    assert not (tmp_path / "m").exists()


def test_rewards_source_never_evaluates_text() -> None:
    """No code path (strings and comments excluded) names eval/exec/compile/__import__,
    sympy's eval-based parsers, math-verify's expression mode, or pickle."""
    forbidden = {"eval", "exec", "compile", "__import__", "parse_expr", "sympify", "ExprExtractionConfig", "pickle"}
    sources = sorted(REWARDS_SRC.glob("*.py"))
    assert len(sources) >= 5
    for path in sources:
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline))
        hits = [
            (tok.start[0], tok.string) for i, tok in enumerate(tokens)
            if tok.type == tokenize.NAME and tok.string in forbidden
            and not (tok.string == "compile" and i > 0 and tokens[i - 1].string == ".")  # re.compile
        ]
        assert hits == [], f"{path.name}: {hits}"
    # The check itself can fail:
    bad = list(tokenize.generate_tokens(io.StringIO("x = eval(s)\n").readline))
    assert any(t.string == "eval" and t.type == tokenize.NAME for t in bad)
