#!/usr/bin/env bash
# Installs everything from scratch into a fresh Python >= 3.12 venv and runs the checks:
#   mypy --strict on the subsystem and the build tools, the Sphinx docs with -W,
#   a negative control (the routing tests must FAIL against unpatched upstream 0.19.2),
#   the test suite (GPU tests are reported as skipped, with the reason, without CUDA + TE).
# Usage: bash scripts/run-tests.sh [extra pytest args]    (VENV=dir to choose the venv)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/find-python.sh
find_python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv=${VENV:-$work/venv}
echo "== venv $venv ($("$PYTHON" --version))"
"$PYTHON" -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install -q --upgrade pip

echo "== install: pip install . -r requirements/test.txt -r requirements/docs.txt"
python -m pip install -q . -r requirements/test.txt -r requirements/docs.txt
python -m pip show megatron-core | grep -E '^(Name|Version):'
echo "== install the example plugin (opt-in precision-aware adopter, entry point)"
python -m pip install -q ./examples/te-precision-aware-adopter

echo "== mypy --strict"
python -m mypy megatron/core/optimizer/state_adoption build_tools setup.py examples/te-precision-aware-adopter/src \
  upstream/build_series.py upstream/make_gpu_bundle.py upstream/pytest_outcomes.py

echo "== docs: sphinx -W (warnings are errors)"
python -m sphinx -W --keep-going -q -b html docs "$work/docs-html"

echo "== negative control: routing tests against unpatched upstream megatron-core 0.19.2"
unpatched="$work/unpatched"
upstream_wheel=${MCORE_UPSTREAM_WHEEL:-$(ls build/upstream/megatron_core-0.19.2-*.whl | head -n 1)}
python -m pip install -q --no-deps --target "$unpatched" "$upstream_wheel"
cp -r megatron/core/optimizer/state_adoption "$unpatched/megatron/core/optimizer/"
if PYTHONPATH="$unpatched" python -m pytest -q tests/test_distributed_optimizer_integration.py \
    > "$work/negative.log" 2>&1; then
  cat "$work/negative.log"
  echo "negative control broken: the routing tests pass without the patch" >&2
  exit 1
fi
echo "ok: $(grep -Eo '[0-9]+ failed' "$work/negative.log") against unpatched upstream, as expected"

echo "== tests: python -m pytest"
python -m pytest "$@"
