"""rlhfkit.algos: the pure algorithm core (tensors and plain scalars in, tensors out).

Imports nothing of the project but :mod:`rlhfkit.types`, and no transformers, accelerate, datasets or
I/O. docs/design.md, "The algorithm core", states the conventions every function here shares (shapes, masks,
the ``done`` convention, KL units); each function's docstring cites its paper.
"""

from rlhfkit.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    gae_advantages,
    gae_loop,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rlhfkit.algos.gae_scan import compute_gae, discounted_cumsum
from rlhfkit.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    last_valid_index,
    shape_rewards,
)
from rlhfkit.algos.losses import (
    bradley_terry_loss,
    dpo_loss,
    entropy_from_logits,
    ppo_policy_loss,
    value_loss,
)
from rlhfkit.algos.masked import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    aggregate_loss,
    explained_variance,
    loss_normalizer,
    masked_mean,
    masked_moments,
    masked_sum,
    masked_var,
    masked_whiten,
)
from rlhfkit.algos.rollout_correction import tis_weights

__all__ = [
    "AdaptiveKLController",
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "aggregate_loss",
    "bradley_terry_loss",
    "compute_gae",
    "discounted_cumsum",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "FixedKLController",
    "gae_advantages",
    "gae_loop",
    "grpo_advantages",
    "kl_estimator",
    "KL_ESTIMATORS",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "KLEstimator",
    "last_valid_index",
    "LOSS_AGGREGATIONS",
    "loss_normalizer",
    "LossAggregation",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "shape_rewards",
    "tis_weights",
    "value_loss",
]
