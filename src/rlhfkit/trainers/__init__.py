"""One readable loop per family: ``sft.py``, ``reward.py`` (Bradley-Terry reward model), ``prm.py`` (process
reward model) and ``dpo.py`` share the offline loop of ``loop.py`` (the two scalar models also share
``scalar_run.py``); ``online.py`` is PPO with a critic, or GRPO / RLOO / REINFORCE++ without (its stages in
``online_steps.py``, ``online_shaping.py`` and ``online_update.py``)."""
