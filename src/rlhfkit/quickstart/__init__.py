"""``rlhfkit quickstart``: whole pipelines on the built-in offline tasks, by calling the trainers (no training
code of their own).

- :mod:`~rlhfkit.quickstart.pipeline`: the reviews task, classic RLHF: SFT -> labelled pairs -> reward model
  -> PPO, beside DPO on the same pairs -> evaluation -> report (``rlhfkit quickstart``);
- :mod:`~rlhfkit.quickstart.verifiable`: the arithmetic task, RL from a rule reward, an outcome reward model
  and a process reward model (``rlhfkit quickstart --task arithmetic``);
- :mod:`~rlhfkit.quickstart.tool_use`: the tools task, SFT on tool-use demonstrations -> GRPO with the
  calculator tool over multi-turn episodes (``rlhfkit quickstart --task tools``);
- :mod:`~rlhfkit.quickstart.distillation`: on-policy distillation of the reviews task's PPO policy (the
  small model) into an SFT policy of the tiny model (``rlhfkit quickstart --task distill``);
- :mod:`~rlhfkit.quickstart.stages`: the SFT stage they share and the summary they write;
  :mod:`~rlhfkit.quickstart.dpo_stage`: the DPO stage and the policies' comparison table;
  :mod:`~rlhfkit.quickstart.summary`: the reviews quickstart's summary table and page.
"""
