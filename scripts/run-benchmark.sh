#!/usr/bin/env bash
# The main job: installs this build into a fresh Python >= 3.12 venv and runs the GPU resume
# benchmark (python -m benchmarks.resume_benchmark), passing on every argument.
# Needs an NVIDIA GPU and Transformer Engine (e.g. an NGC PyTorch container); without them it
# says what is missing and exits with code 2. The venv (.venv-benchmark) sees the packages of
# the Python that runs this script ($PYTHON, else python3 on PATH, ...: see find-python.sh): if
# that Python is itself a venv (venv, virtualenv, uv), the new one is layered over it, else it
# gets --system-site-packages (system or container Python, conda).
# Before the GPU check and before any venv or install, every argument is checked (the
# benchmark's with its own --check-command-line, and the variables below): a usage error is one
# line naming the argument at fault, and exit code 2. --help works anywhere.
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

usage_error() {  # one line naming the argument at fault, exit 2
  echo "run-benchmark.sh: error: $*; see --help" >&2
  exit 2
}
usage() {
  cat <<'EOF'
usage: bash scripts/run-benchmark.sh [benchmark arguments, below]

Installs this megatron-core build into a venv that sees the torch and Transformer Engine of the
Python running this script, then runs python -m benchmarks.resume_benchmark with the arguments.
Needs an NVIDIA GPU; every argument is checked first (--check-command-line), on any machine.

environment:
  PYTHON=PATH     the Python >= 3.12 to make the venv with (default: python3 on PATH, ...)
  VENV=DIR        the venv (default .venv-benchmark); an existing one not made here is used as is
  WHEELHOUSE=DIR  offline: pip installs only from DIR and is not upgraded
  BUILD=WHEEL     install that wheel of this build instead of building this checkout
  BUILD=DIR       a site with this build (pip install --target DIR): nothing is installed

EOF
}
# missing PATH WHAT: why PATH, which does not exist, is not there
missing() {
  local parent blocking
  parent=$(dirname -- "$1")
  blocking=$parent
  while [[ ! -e $blocking && ! -L $blocking ]]; do blocking=$(dirname -- "$blocking"); done
  if [[ -d $blocking ]]; then
    echo "no such $2"
  elif [[ $blocking == "$parent" ]]; then
    echo "its parent $blocking is a file, not a directory"
  else
    echo "$blocking is a file, not a directory"
  fi
}
# input_dir LABEL DIR: DIR is a directory to read (LABEL names the setting in messages)
input_dir() {
  if [[ -d $2 ]]; then
    [[ -r $2 && -x $2 ]] || usage_error "$1: the directory is not readable"
  elif [[ -e $2 || -L $2 ]]; then
    usage_error "$1: is a file, not a directory"
  else
    usage_error "$1: $(missing "$2" directory)"
  fi
}
# dir_to_make LABEL DIR: DIR is a writable directory, or one that can be made (with parents)
dir_to_make() {
  local blocking
  if [[ -d $2 ]]; then
    [[ -w $2 && -x $2 ]] || usage_error "$1: the directory is not writable"
    return 0
  fi
  [[ ! -e $2 && ! -L $2 ]] || usage_error "$1: is a file, not a directory"
  blocking=$(dirname -- "$2")
  while [[ ! -e $blocking && ! -L $blocking ]]; do blocking=$(dirname -- "$blocking"); done
  [[ -d $blocking ]] || usage_error "$1: $(missing "$2" directory)"
  [[ -w $blocking && -x $blocking ]] || usage_error "$1: cannot be made: $blocking is not writable"
}

source scripts/find-python.sh
if [[ -n ${PYTHON:-} ]] && ! _is_py312_plus "$PYTHON"; then
  usage_error "PYTHON=$PYTHON: not a Python >= 3.12 interpreter"
fi
find_python || exit 2  # none: it says so
for arg in "$@"; do  # --help (anywhere before --) wins, as in the benchmark itself
  [[ $arg == -- ]] && break
  case $arg in
    -h | --h | --he | --hel | --help)
      usage
      exec "$PYTHON" -m benchmarks.resume_benchmark --help
      ;;
  esac
done

venv=${VENV:-.venv-benchmark}
if [[ -n ${VENV:-} ]]; then
  dir_to_make "VENV=$VENV" "$VENV"
else
  dir_to_make "VENV (unset: the default $venv)" "$venv"
fi
if [[ -n ${WHEELHOUSE:-} ]]; then
  input_dir "WHEELHOUSE=$WHEELHOUSE" "$WHEELHOUSE"
fi
build_args=()
if [[ -n ${BUILD:-} ]]; then
  if [[ -d $BUILD ]]; then
    input_dir "BUILD=$BUILD" "$BUILD"
    build_args=(--build "$BUILD")
  elif [[ ! -e $BUILD && ! -L $BUILD ]]; then
    usage_error "BUILD=$BUILD: $(missing "$BUILD" "file or directory")"
  elif [[ ! -f $BUILD || $BUILD != *.whl ]]; then
    usage_error "BUILD=$BUILD: is neither a wheel (*.whl) nor a directory"
  elif [[ ! -r $BUILD ]]; then
    usage_error "BUILD=$BUILD: the wheel is not readable"
  fi
fi
# the benchmark's own arguments, with the interpreter alone (standard library: nothing installed)
"$PYTHON" -m benchmarks.resume_benchmark --check-command-line "${build_args[@]}" "$@"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "cannot run the resume benchmark here: no NVIDIA GPU is visible (nvidia-smi is missing or" \
       "lists no device). It measures a GPU memory peak of Transformer Engine's FusedAdam and" \
       "needs a CUDA GPU; the CPU test suite is: bash scripts/run-tests.sh" >&2
  exit 2
fi
# The venv sees the packages of $PYTHON's environment (torch and Transformer Engine of the
# machine, e.g. an NGC container, or of the user's own venv/uv/conda environment): layered over
# a virtual environment through a .pth file, else --system-site-packages; one line says which
# (benchmarks/resume_benchmark/environment.py).
"$PYTHON" -m benchmarks.resume_benchmark.environment "$venv" ${VENV:+--given}
# shellcheck disable=SC1091
source "$venv/bin/activate"
pip_args=(-q)
if [[ -n ${WHEELHOUSE:-} ]]; then
  pip_args+=(--no-index --find-links "$WHEELHOUSE")
  echo "offline: installing only from $WHEELHOUSE" >&2
else
  python -m pip install -q --upgrade pip
fi
if [[ -z ${BUILD:-} ]]; then
  python -m pip install "${pip_args[@]}" .
elif [[ -d $BUILD ]]; then
  echo "using the build in $BUILD (nothing installed)" >&2
else
  python -m pip install "${pip_args[@]}" "$BUILD"
fi
exec python -m benchmarks.resume_benchmark "${build_args[@]}" "$@"
