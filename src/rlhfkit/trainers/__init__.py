"""One readable loop per family: ``sft.py``, ``reward.py`` (Bradley-Terry reward model), ``prm.py`` (process
reward model) and ``dpo.py`` share the offline loop of ``offline.py`` (the two scalar models also share
``scalar_run.py``; every trainer ends its run through ``common.py``); the ``online`` package is PPO with a
critic, or GRPO / RLOO / REINFORCE++ without, one loop of five numbered stages (``online/loop.py``).
Every trainer's entry point is ``train(cfg, resume, overwrite) -> summary``."""
