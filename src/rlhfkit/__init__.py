"""rlhfkit: classic RLHF (SFT, reward model, PPO with GAE) on Hugging Face language models.

The layers, from the bottom up (arrows point downward only):

    cli -> pipeline -> trainers -> rollout / models / data / engine -> algos / types

`rlhfkit.algos` is pure tensor math and imports nothing heavy, so ``import rlhfkit`` stays cheap.
"""

__version__ = "0.1.0"
