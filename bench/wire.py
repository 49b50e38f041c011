"""Wire-format benchmark: encode/decode time and bytes per token of a Trajectory.

Run: ``.venv/bin/python bench/wire.py [--reps 20]``

For 1K, 8K and 32K-token trajectories (a quarter prompt, the rest response with a tool
segment of mask-0 tokens), it measures the asyncrl encoding (msgspec MessagePack, typed
decode with invariant checks) against a baseline in the same run: orjson of the same
fields as plain JSON, decoded without validation, and decoded into the same typed
Trajectory with the same invariant checks (the fair comparison). Prints one table.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import msgspec
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.wire import Trajectory, decode_trajectory, encode_trajectory  # noqa: E402

# ruff: noqa: B023  (the lambdas are timed immediately, inside the loop iteration they capture)


def make_trajectory(total_tokens: int, seed: int = 0) -> Trajectory:
    rng = random.Random(seed)
    prompt = total_tokens // 4
    resp = total_tokens - prompt
    mask = [0 if (i // 64) % 5 == 4 else 1 for i in range(resp)]  # every fifth 64-token block is a tool result
    return Trajectory(
        id=f"traj-{seed:08d}-{total_tokens}", run_id="bench", group_id="g", group_size=8, group_index=3, prompt_id="p",
        data_source="bench", token_ids=[rng.randrange(151_000) for _ in range(total_tokens)], prompt_length=prompt,
        loss_mask=mask, rollout_logprobs=[-rng.random() * 5 if m else 0.0 for m in mask],
        weight_versions=[7 + i * 2 // resp if m else -1 for i, m in enumerate(mask)], reward=1.0,
        reward_details={"correct": 1.0}, num_turns=4, num_tool_calls=3, version_start=7, version_end=8,
        timings={"generate": 1.5, "tools": 0.2, "total": 2.0},
    )


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    print(f"command: python bench/wire.py --reps {args.reps}")
    print(f"{'tokens':>7} {'format':<28} {'encode ms':>10} {'decode ms':>10} {'bytes/token':>12}")
    for n in (1024, 8192, 32768):
        traj = make_trajectory(n)
        as_dict = msgspec.to_builtins(traj)
        payload = encode_trajectory(traj)
        assert decode_trajectory(payload) == traj
        baseline = orjson.dumps(as_dict)
        rows = [
            ("orjson JSON (baseline)", best_ms(lambda: orjson.dumps(as_dict), args.reps),
             best_ms(lambda: orjson.loads(baseline), args.reps), len(baseline) / n),
            ("orjson JSON + same checks", best_ms(lambda: orjson.dumps(as_dict), args.reps),
             best_ms(lambda: msgspec.convert(orjson.loads(baseline), Trajectory), args.reps), len(baseline) / n),
            ("asyncrl msgpack + checks", best_ms(lambda: encode_trajectory(traj), args.reps),
             best_ms(lambda: decode_trajectory(payload), args.reps), len(payload) / n),
        ]
        for name, enc, dec, bpt in rows:
            print(f"{n:>7} {name:<28} {enc:>10.3f} {dec:>10.3f} {bpt:>12.1f}")
        print(f"{n:>7} {'size ratio baseline/asyncrl':<28} {'':>10} {'':>10} {len(baseline) / len(payload):>12.2f}")


if __name__ == "__main__":
    main()
