"""gamma < 1 favours short answers: PPO at gamma in {1, 0.99, 0.9} on the built-in task, response length and gold
over training. ``ppo_sweep.py --sweep gamma``: see its docstring::

    RLHFKIT_NUM_THREADS=1 python examples/experiments/gamma.py --out runs/ppo_sweep --jobs 2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--sweep", "gamma", *sys.argv[1:]]))
