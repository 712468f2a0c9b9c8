#!/usr/bin/env bash
# The main job: installs this build into a fresh Python >= 3.12 venv and runs the GPU resume
# benchmark (python -m benchmarks.resume_benchmark), passing on every argument.
# Needs an NVIDIA GPU and Transformer Engine (e.g. an NGC PyTorch container); without them it
# says what is missing and exits with code 2. The venv (.venv-benchmark) sees the packages of
# the Python that runs this script ($PYTHON, else python3 on PATH, ...: see find-python.sh): if
# that Python is itself a venv (venv, virtualenv, uv), the new one is layered over it, else it
# gets --system-site-packages (system or container Python, conda).
# Usage: bash scripts/run-benchmark.sh [benchmark args, see --help]
#   VENV=DIR  an existing environment is used as it is (one this script made is updated);
#             a new DIR is made as above
# Offline (no package index):
#   WHEELHOUSE=DIR  pip installs only from DIR (--no-index --find-links DIR) and pip is not
#                   upgraded; DIR holds the wheels the venv lacks beyond the machine's packages
#   BUILD=WHEEL     installs that wheel of this build (e.g. from `pip wheel --no-deps .` on a
#                   machine with an index) instead of building this checkout
#   BUILD=DIR       a site with this build (`pip install --target DIR ...`): nothing is
#                   installed, the benchmark gets --build DIR
# and give upstream as a wheel or site: --upstream WHEEL|DIR (else it is fetched from PyPI).
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
# The venv sees the packages of $PYTHON's environment (torch and Transformer Engine of the
# machine, e.g. an NGC container, or of the user's own venv/uv/conda environment): layered over
# a virtual environment through a .pth file, else --system-site-packages; one line says which
# (benchmarks/resume_benchmark/environment.py).
"$PYTHON" -m benchmarks.resume_benchmark.environment "$venv" ${VENV:+--given}
# shellcheck disable=SC1091
source "$venv/bin/activate"
pip_args=(-q)
if [[ -n ${WHEELHOUSE:-} ]]; then
  [[ -d $WHEELHOUSE ]] || { echo "WHEELHOUSE=$WHEELHOUSE is not a directory" >&2; exit 2; }
  pip_args+=(--no-index --find-links "$WHEELHOUSE")
  echo "offline: installing only from $WHEELHOUSE" >&2
else
  python -m pip install -q --upgrade pip
fi
build_args=()
if [[ -z ${BUILD:-} ]]; then
  python -m pip install "${pip_args[@]}" .
elif [[ -d $BUILD ]]; then
  echo "using the build in $BUILD (nothing installed)" >&2
  build_args=(--build "$BUILD")
elif [[ -f $BUILD && $BUILD == *.whl ]]; then
  python -m pip install "${pip_args[@]}" "$BUILD"
else
  echo "BUILD=$BUILD is neither a wheel (*.whl) nor a directory" >&2
  exit 2
fi
exec python -m benchmarks.resume_benchmark "${build_args[@]}" "$@"
