"""rlhfkit: classic RLHF (SFT, reward model, PPO with GAE) on Hugging Face language models.

The layers, highest first (a module imports only from its own layer or lower ones; docs/design.md, "The
layers", and tests/test_layers.py):

    cli > commands > quickstart > trainers > reporting > rollout > models / data / tasks > engine > config
    > algos > types / errors

`rlhfkit.algos` is pure tensor math and imports nothing heavy, so ``import rlhfkit`` stays cheap.
"""

__version__ = "0.1.0"
