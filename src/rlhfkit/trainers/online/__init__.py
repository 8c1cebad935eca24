"""Online RL from a reward signal: PPO with a critic, and GRPO / RLOO / REINFORCE++ without one, in ONE loop.

PPO for language models as in Ziegler et al. 2019 and Ouyang et al. 2022, with the implementation details
of Huang et al. 2024 ("The N+ Implementation Details of RLHF with PPO"). Every rollout (``train.max_steps``
of them) runs five stages, numbered in :func:`train_online`:

1. **generate**: ``train.batch_size`` prompts (a stateless function of (seed, rollout number)) and
   ``online.group_size`` responses each, sampled from the actor at ``online.temperature`` (top-p / top-k
   optional) from LEFT-padded prompts, with torch's generator seeded from (seed, rollout number, process)
   (so resuming needs no sampler state, and every process samples its own noise); each response is cut after its first stop token (EOS, or also
   ``online.stop_token``), the stop token inside the mask and everything after it outside, also when the
   pad token is EOS. The log-probs of the actor and of the frozen reference, and the critic's values, are
   recomputed at the sampling temperature (never taken from ``generate``: OpenRLHF PR #853, trl#2358).
   With ``online.tools`` / ``online.environment`` each response is a multi-turn episode
   (:mod:`rlhfkit.rollout.episodes`, docs/tools.md): the model's sampled tokens are the mask, the tool results
   between its turns are read by the forwards but trained nowhere (losses, KL, entropy, values, statistics).
2. **score**: the frozen reward model (normalised by the reward trainer) and/or reward functions
   (:mod:`rlhfkit.rollout.scoring`, TRL's keyword convention). A response that nothing scores (every function
   returned None) is left out of every loss and counted (``score/unscored``). A reward function that raises or
   returns a wrong count stops the run after a checkpoint of the last completed rollout (:func:`score_or_stop`),
   so that ``--resume`` continues once it is fixed. A response that hits ``online.response_length`` without a stop token
   is scored ``online.missing_eos_score`` (``missing_eos=penalty``, the N+ "EOS trick"), or left out of
   every loss (``mask``: its tokens are masked and, for grpo/rloo, it leaves its group), or scored as it is
   (``none``). Optional clipping to ``[-score_clip, score_clip]``.
3. **KL-shaped rewards**: ``shape_rewards``: the score on each response's last real token and
   ``-kl_coef * kl_t`` on every token, with the ``k1``/``k2``/``k3`` estimator; ``kl_coef`` fixed or adaptive
   (Ziegler et al. 2019, ``online.kl_target``). The logged ``kl/mean`` (nats per response: the batch mean of
   the per-sequence sum) and ``kl/per_token`` are of the very ``kl_t`` that is trained on (trl#1161).
4. **advantages**: ``ADVANTAGE_ESTIMATORS[online.advantage_estimator]``: GAE over the critic's values
   (gamma 1, lam 0.95, whitened; the returns train the critic), or grpo / rloo / reinforce_pp (no critic).
5. **PPO epochs**: ``online.ppo_epochs`` passes over the rollout in ``online.num_minibatches`` shuffled
   minibatches, one optimizer step each for the actor and the critic (separate AdamW, learning rates and
   schedules; gradient clipping), accumulated over micro-batches of ``train.micro_batch_size`` responses.
   Clipped surrogate (Schulman et al. 2017, eq. 7), clipped value loss times ``vf_coef``, entropy bonus
   ``ent_coef``, each aggregated by ``aggregate_loss`` with the whole minibatch as normaliser.

Each stage is one call in :func:`rlhfkit.trainers.online.loop.train_online`: :func:`~rlhfkit.trainers.online.collect.sample_rollout` (1) and
:func:`~rlhfkit.trainers.online.collect.score_rollout` (2), :func:`~rlhfkit.trainers.online.shaping.shape_rollout`
(3) and :func:`~rlhfkit.trainers.online.shaping.estimate_advantages` (4),
:func:`~rlhfkit.trainers.online.ppo_update.ppo_update` (5). The :class:`rlhfkit.types.Rollout` carries what they
compute, the response mask and the actor's entropy included.

Before the first ``online.critic_warmup_steps`` rollouts end, only the critic is trained (Zheng et al. 2023).
Learning-rate schedules count rollouts (one scheduler step per rollout).

Under data parallelism (N processes, :mod:`rlhfkit.engine.accel`) each process generates for a contiguous
slice of the rollout's prompts, whole groups included, and N processes compute what one process computes on
the same rollout: advantages are whitened with the whole rollout's mean and variance (one all-reduce; TRL
whitens each process's share, which makes the result depend on N), a prompt's group is never split between
processes (checked), the minibatches are cut from the whole rollout, loss normalisers count the whole
minibatch, the KL controller reads the whole rollout's KL, and the logged statistics are summed over
processes once per rollout. Only the sampling noise depends on N (each process seeds its own from
(seed, rollout, process)).

Files: ``metrics.jsonl`` (one line per rollout: ``score/mean`` (as trained), ``score/raw_mean`` and each
reward function's own ``score/<name>``, ``score/penalised_frac``, ``kl/mean``, ``kl/per_token``, ``kl_coef``,
``loss/policy``, ``loss/value``, ``entropy/mean``, ``clipfrac``, ``approx_kl`` (and ``clipfrac/epochK``,
``approx_kl/epochK`` per PPO epoch with ``online.epoch_stats``), ``ratio/mean``,
``value/explained_variance``, ``grad_norm/<role>``, ``learning_rate/<role>``,
``response_length/mean``, ``advantages/mean``, ``time/*``, ``tokens_per_second``, with a distillation
teacher ``distill/teacher_kl`` (and ``eval/distill/teacher_kl`` held out), ...),
``samples.jsonl`` (``logging.samples_per_step`` responses of each rollout with their scores:
:mod:`rlhfkit.rollout.samples`), with a distillation teacher ``teacher_samples.jsonl`` (the student's and the
teacher's responses to a few prompts at each evaluation: :mod:`rlhfkit.trainers.online.side_by_side`),
``checkpoints/step-N/`` (actor, critic, both optimizers and schedules, the KL controller, RNG states; the
data position is the step), ``final/`` (the policy as a Hugging Face folder) and ``final_critic/`` beside it
(the critic, an ``AutoModelForSequenceClassification`` folder; gae only), ``summary.json``.

Callers such as the pipeline pass :class:`OnlineHooks`: an ``evaluate(policy, step)`` callback (e.g. the
gold score on held-out prompts; its metrics go into ``metrics.jsonl`` as named) and a reward-model refresh
between rollouts. The trainer itself knows nothing of any task.

Launch:
    rlhfkit train ppo --config ppo.yaml                  # one process
    rlhfkit train grpo --config grpo.yaml                # group_size 4 by default, no critic
    rlhfkit train ppo --config ppo.yaml --resume         # continue from the newest complete checkpoint
    torchrun --standalone --nproc_per_node 2 -m rlhfkit.cli train ppo --config ppo.yaml   # 2 processes
"""

from rlhfkit.trainers.online.hooks import OnlineHooks
from rlhfkit.trainers.online.loop import CRITIC_DIR, train

__all__ = ["CRITIC_DIR", "OnlineHooks", "train"]
