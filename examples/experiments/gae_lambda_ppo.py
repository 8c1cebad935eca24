"""GAE's lambda trades bias for variance, what it does to learning: PPO at lambda in {0, 0.5, 0.9, 0.95, 1} on the
built-in task, gold and proxy along the runs (``gae_lambda.py`` measures the bias and variance themselves for one
fixed policy and critic). ``ppo_sweep.py --sweep lam``: see its docstring::

    RLHFKIT_NUM_THREADS=1 python examples/experiments/gae_lambda_ppo.py --out runs/ppo_sweep --jobs 2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--sweep", "lam", *sys.argv[1:]]))
