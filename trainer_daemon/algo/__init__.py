"""Pure tensor math of the trainer: advantages, policy/actor loss, KL, entropy, loss aggregation,
truncated importance sampling, data-parallel balancing and weight-version bookkeeping.

No distributed calls, no model code, no global state. Formulas, knobs and verl's names are in
``docs/algorithms.md``; each module's docstring states its formula, shapes and what it omits.
"""

from trainer_daemon.algo.actor_loss import compute_actor_loss
from trainer_daemon.algo.advantages import (
    grpo_advantages,
    grpo_token_advantages,
    outcome_advantages,
    rloo_advantages,
    zero_variance_groups,
    zero_variance_mask,
)
from trainer_daemon.algo.aggregation import (
    LOSS_AGG_MODES,
    agg_loss,
    count_tokens_and_seqs,
    masked_mean,
)
from trainer_daemon.algo.balance import balance_across_ranks, plan_mini_batch, split_micro_batches
from trainer_daemon.algo.kl import KL_TYPES, kl_penalty
from trainer_daemon.algo.logprobs import (
    entropy_from_logits,
    log_probs_and_entropy,
    log_probs_from_logits,
)
from trainer_daemon.algo.policy_loss import (
    compute_policy_loss,
    resolve_log_probs,
)
from trainer_daemon.algo.staleness import (
    StalenessBound,
    VersionInfo,
    batch_version_metrics,
    max_version_lag,
    model_version_range,
    version_info,
)

__all__ = [
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "StalenessBound",
    "VersionInfo",
    "agg_loss",
    "balance_across_ranks",
    "batch_version_metrics",
    "compute_actor_loss",
    "compute_policy_loss",
    "count_tokens_and_seqs",
    "entropy_from_logits",
    "grpo_advantages",
    "outcome_advantages",
    "rloo_advantages",
    "grpo_token_advantages",
    "kl_penalty",
    "log_probs_and_entropy",
    "log_probs_from_logits",
    "masked_mean",
    "max_version_lag",
    "model_version_range",
    "plan_mini_batch",
    "resolve_log_probs",
    "split_micro_batches",
    "version_info",
    "zero_variance_groups",
    "zero_variance_mask",
]
