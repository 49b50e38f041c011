"""Is a published trajectory exactly what the engines returned? Checked against the /generate
exchanges a ``tests.helpers.recording_proxy.RecordingProxy`` saw (any engine: local_engine or
real SGLang).

``mismatches(traj, exchanges)`` lists every way ``traj`` differs from the calls made for it
(``rid`` starting ``rl-<run>.<traj id>.``; the OpenAI session path's calls are matched by their
input instead): each answered call's ``input_ids`` is a prefix of the trajectory's tokens and
its output tokens follow that prefix in the trajectory, with loss mask 1, the same log-probs
and the weight version the engine reported for each token (its ``weight_versions`` spans, else
its ``weight_version``; ``version_of`` maps the engine's label to the trajectory's int,
``"default"`` being 0); every
loss-mask-1 token is covered by exactly one call. An aborted call's tokens count where the
trajectory kept them (partial rollout); a call the trajectory did not keep (its tokens absent)
is named. An empty list means exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from asyncrl.engine_client.types import GenerateResult
from asyncrl.wire.sync import weight_version_number


def calls_for(traj, run_id: str, exchanges: Iterable[tuple[dict, dict]]) -> list[tuple[dict, GenerateResult]]:
    """The answered /generate calls of ``traj``'s agent (by rid), in the order they were made."""
    prefix = f"rl-{run_id}.{traj.id}."
    out = []
    for req, resp in exchanges:
        if isinstance(req, dict) and str(req.get("rid", "")).startswith(prefix) and isinstance(resp, dict) and "meta_info" in resp:
            out.append((req, GenerateResult.parse(resp)))
    return out


def mismatches(traj, calls: list[tuple[dict, GenerateResult]], version_of: Callable[[str | None], int] = weight_version_number,
               tolerance: float = 0.0) -> list[str]:
    problems: list[str] = []
    tokens = list(traj.token_ids)
    p = traj.prompt_length
    covered = [0] * traj.response_length
    for req, res in calls:
        ids = req.get("input_ids")
        if not isinstance(ids, list) or tokens[: len(ids)] != ids:
            problems.append(f"call {res.rid}: its input_ids are not a prefix of the trajectory")
            continue
        start = len(ids) - p
        n = len(res.output_ids)
        if n == 0:
            continue
        if tokens[len(ids): len(ids) + n] != res.output_ids:
            if res.aborted:
                problems.append(f"call {res.rid} (aborted): its {n} tokens are not those after its input")
            else:
                problems.append(f"call {res.rid}: output {res.output_ids[:8]}... is not the trajectory's tokens "
                                f"{tokens[len(ids): len(ids) + min(n, 8)]}... at response position {start}")
            continue
        versions = res.token_versions()
        for i in range(n):
            j = start + i
            covered[j] += 1
            if traj.loss_mask[j] != 1:
                problems.append(f"call {res.rid}: response token {j} came from the engine but has loss mask 0")
            if res.logprobs is not None and abs(traj.rollout_logprobs[j] - res.logprobs[i]) > tolerance:
                problems.append(f"call {res.rid}: token {j} log-prob {traj.rollout_logprobs[j]} != engine's {res.logprobs[i]}")
            if traj.weight_versions[j] != version_of(versions[i]):
                problems.append(f"call {res.rid}: token {j} version {traj.weight_versions[j]} != engine's {versions[i]}")
    for j, m in enumerate(traj.loss_mask):
        if m == 1 and covered[j] != 1:
            problems.append(f"response token {j} (mask 1) came from {covered[j]} engine calls, not exactly one")
    return problems
