"""What a decoded trajectory must satisfy before the trainer holds it: the checks that need the
run and the model, beyond the wire invariants (issue 30 item 6).

- ``run_id`` is this run's: a message of another run (a misrouted publisher, a reused stream)
  must not train this policy;
- every token id is below the policy's vocabulary (its embedding rows): an id beyond it makes
  the embedding lookup fail inside the step;
- the sequence is at most ``model.max_model_len`` tokens: longer ones exceed what the run
  was sized for (and the position embeddings of many models).

A trajectory that fails is *poison*: terminated, copied to the dead-letter subject with the
reason, counted — never held, so it can neither crash a step nor be replayed after every
restart (a crash loop). The run goes on with the rest of its group.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.wire import Trajectory


def admission_check(run_id: str, vocab_size: int, max_tokens: int) -> Callable[[Trajectory], str]:
    """A function naming why a trajectory cannot be trained by this run's policy, or ""."""
    if vocab_size < 1 or max_tokens < 1:
        raise ValueError(f"vocab_size ({vocab_size}) and max_tokens ({max_tokens}) must be >= 1")

    def reason(traj: Trajectory) -> str:
        if traj.run_id != run_id:
            return f"run_id {traj.run_id[:80]!r} is not this run's ({run_id!r})"
        if len(traj.token_ids) > max_tokens:
            return f"{len(traj.token_ids)} tokens exceed model.max_model_len = {max_tokens}"
        top = max(traj.token_ids, default=0)
        if top >= vocab_size:
            return f"token id {top} is outside the policy's vocabulary of {vocab_size}"
        return ""

    return reason
