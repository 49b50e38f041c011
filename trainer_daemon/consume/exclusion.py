"""Which delivered trajectories the trainer never trains, and the reason it records.

A trajectory is excluded (resolved without training, counted per reason in the consumption
state's ``excluded/<reason>`` counters, logged, and listed as ``dropped`` in the ledger) when:

- ``failure`` is set: an infrastructure failure spoiled it (the engine failed, the reward
  function crashed, an environment call expired, the agent crashed). Its reward says nothing
  about the policy, so it must not become learning signal;
- it carries no ``failure`` but finished with ``finish_reason`` ``error`` or ``expired`` (a
  publisher older than the ``failure`` field): the same failures, named from the reason;
- ``actor.truncated_sampling = "drop"`` and some of its tokens were sampled from a truncated
  distribution (top-p < 1, top-k > 0 or min-p > 0) whose behaviour log-probs were not recorded
  (``Trajectory.truncation_uncorrected``): reason ``truncated_sampling``. Their logprobs
  describe the untruncated distribution (SGLang's rule), which the trainer reproduces exactly,
  but the tokens were drawn from the truncated one, so the importance ratio ignores the
  truncation. With ``"train"`` (the default) they are trained and counted
  (``trainer/truncated_sampling_trajectories``); docs/algorithms.md, "What is trained".
  Truncated spans with behaviour log-probs (the engine's sampling mask) are exact: trained
  under either rule, never counted.

Genuine task failures (a wrong answer, a tool error the model caused, a length cut) are
trained with the reward they got.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.wire import Trajectory

FAILURE_FROM_FINISH = {"error": "engine_error", "expired": "environment_expired"}
TRUNCATED = "truncated_sampling"


def exclusion_reason(traj: Trajectory, truncated_sampling: str = "train") -> str:
    """Why ``traj`` must not be trained, or "" (module docstring)."""
    if traj.failure:
        return traj.failure
    legacy = FAILURE_FROM_FINISH.get(traj.finish_reason)
    if legacy:
        return legacy
    if truncated_sampling == "drop" and traj.truncation_uncorrected:
        return TRUNCATED
    return ""


def excluder(truncated_sampling: str) -> Callable[[Trajectory], str]:
    """:func:`exclusion_reason` with the run's ``actor.truncated_sampling`` rule bound."""
    if truncated_sampling not in ("train", "drop"):
        raise ValueError(f"truncated_sampling must be 'train' or 'drop', got {truncated_sampling!r}")
    return lambda traj: exclusion_reason(traj, truncated_sampling)
