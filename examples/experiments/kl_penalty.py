"""The KL penalty trades reward for staying close: PPO at kl_coef in {0, 0.02, 0.05, 0.2} on the built-in task,
gold vs proxy vs KL at the end and along the run. ``ppo_sweep.py --sweep kl_coef``: see its docstring::

    RLHFKIT_NUM_THREADS=1 python examples/experiments/kl_penalty.py --out runs/ppo_sweep --jobs 2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--sweep", "kl_coef", *sys.argv[1:]]))
