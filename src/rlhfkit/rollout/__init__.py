"""Generation and scoring of responses for online RL and for labelling preference pairs.

- :mod:`rlhfkit.rollout.generation`: sampling with Hugging Face ``generate`` from left-padded prompts,
  cutting each response at its first stop token (EOS kept inside the mask, also when pad == EOS).
- :mod:`rlhfkit.rollout.scoring`: scores from a reward model and/or Python reward functions.
"""

from rlhfkit.rollout.generation import Responses, generate_responses, truncate_at_stop

__all__ = ["Responses", "generate_responses", "truncate_at_stop"]
