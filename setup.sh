#!/usr/bin/env bash
# One-step set-up for rlhfkit on a fresh machine.
# On a machine without an NVIDIA GPU it installs the CPU build of torch first, so that the
# bare `torch` requirement does not pull a CUDA build of several GB; then the project with
# its development extras (tests, linters, the CartPole example).
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        "$PY" -m pip install --quiet "torch>=2.4"
    else
        "$PY" -m pip install --quiet "torch==2.13.0"
    fi
fi
"$PY" -m pip install --quiet -e ".[dev]"
