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
        "$PY" -m pip install --quiet "torch>=2.6"
    else
        "$PY" -m pip install --quiet "torch==2.13.0"
    fi
fi
"$PY" -m pip install --quiet -e ".[dev]"
# Headless Chromium for the report page's browser test (tests/reporting/test_report_browser.py), from Debian's
# packages: only where apt-get exists and we are root, quietly, and never failing the set-up (without it
# that test is skipped with its reason).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
        >/dev/null 2>&1 || echo "setup.sh: could not install chromium; the browser test will be skipped" >&2
fi
