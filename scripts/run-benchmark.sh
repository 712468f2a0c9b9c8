#!/usr/bin/env bash
# The main job: installs this build into a fresh Python >= 3.12 venv and runs the GPU resume
# benchmark (python -m benchmarks.resume_benchmark), passing on every argument.
# Needs an NVIDIA GPU and Transformer Engine (e.g. an NGC PyTorch container, whose packages the
# venv sees); without them it says what is missing and exits with code 2.
# Usage: bash scripts/run-benchmark.sh [benchmark args, see --help]   (VENV=dir to reuse a venv)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "cannot run the resume benchmark here: no NVIDIA GPU is visible (nvidia-smi is missing or" \
       "lists no device). It measures a GPU memory peak of Transformer Engine's FusedAdam and" \
       "needs a CUDA GPU; the CPU test suite is: bash scripts/run-tests.sh" >&2
  exit 2
fi
source scripts/find-python.sh
find_python
venv=${VENV:-.venv-benchmark}
# --system-site-packages: torch and Transformer Engine of the machine (e.g. an NGC container)
[[ -x $venv/bin/python ]] || "$PYTHON" -m venv --system-site-packages "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q .
exec python -m benchmarks.resume_benchmark "$@"
