"""One readable loop per family: ``sft.py``, ``reward.py`` (reward and process reward models) share the
offline loop of ``loop.py``; ``online.py`` is PPO with a critic, or GRPO / RLOO / REINFORCE++ without."""
