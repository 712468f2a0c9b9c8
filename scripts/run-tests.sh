#!/usr/bin/env bash
# Installs everything from scratch into a fresh Python >= 3.12 venv and runs the checks:
#   mypy --strict on the subsystem, the build tools and the benchmark, the Sphinx docs with -W,
#   for every supported megatron-core release X: 'pip wheel .' composes X+stateadoption (the
#   patches apply with --fuzz=0), the routing tests pass against it and FAIL against unpatched
#   upstream X (negative control),
#   the test suite against the default build (GPU tests are reported as skipped, with the
#   reason, without CUDA + TE).
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
echo "== mypy --strict: the resume benchmark (Megatron-Core, TE and TensorBoard as Any)"
python -m mypy --config-file benchmarks/mypy.ini benchmarks/resume_benchmark

echo "== docs: sphinx -W (warnings are errors)"
python -m sphinx -W --keep-going -q -b html docs "$work/docs-html"

echo "== releases: compose each; routing tests pass on it and fail on unpatched upstream"
# routing SITE VERSION LOG: check that megatron-core VERSION in SITE is the one imported, then
# run the routing tests against it (exit 3 if another megatron-core would be tested)
routing() {
  PYTHONPATH="$1" python -P -c 'import pathlib, sys, pytest
site, version = sys.argv[1:3]
dist_info = [p.name for p in pathlib.Path(site).glob("megatron_core-*.dist-info")]
import megatron.core.optimizer.distrib_optimizer as module
if dist_info != [f"megatron_core-{version}.dist-info"] or not module.__file__.startswith(site + "/"):
    print(f"expected megatron-core {version} from {site}: {module.__file__}, {dist_info}")
    sys.exit(3)
print(f"testing megatron-core {version} from {site}", flush=True)
sys.exit(pytest.main(["-q", "tests/test_distributed_optimizer_integration.py",
                      "tests/test_call_site_integration.py", "tests/test_read_hook_point.py"]))' "$1" "$2" > "$3" 2>&1
}
for release in $(python -c 'from build_tools.releases import supported_versions as v; print(*v())'); do
  start=$SECONDS
  build="$work/build-$release" unpatched="$work/upstream-$release"
  # (a) the real build path: GNU patch --fuzz=0; any hunk that does not apply fails the build
  env -u MCORE_UPSTREAM_WHEEL MCORE_UPSTREAM_VERSION="$release" \
    python -m pip wheel -q --no-deps . -w "$work/wheels-$release"
  wheel=$(ls "$work/wheels-$release"/*.whl)
  upstream_wheel=$(python -c 'import sys; from pathlib import Path
from build_tools.upstream import ensure_upstream_wheel as e
print(e(Path("build/upstream"), sys.argv[1], environ={}))' "$release")
  python -m pip install -q --no-deps --target "$unpatched" "$upstream_wheel"
  for patch_file in patches/*.patch; do
    applied=$(LC_ALL=C patch -p1 --fuzz=0 --dry-run --batch --forward -d "$unpatched" \
      -i "$PWD/$patch_file")
    echo "$release: $(basename "$patch_file") applies with --fuzz=0: $(echo "$applied" | tr '\n' ' ')"
  done
  # (b) the routing tests pass against the composed X+stateadoption
  python -m pip install -q --no-deps --target "$build" "$wheel"
  if ! routing "$build" "$release+stateadoption" "$work/routing-$release.log"; then
    cat "$work/routing-$release.log"
    echo "the routing tests fail against the composed megatron-core $release+stateadoption" >&2
    exit 1
  fi
  # (c) negative control: they fail (not error) against unpatched upstream X + this subsystem
  cp -r megatron/core/optimizer/state_adoption "$unpatched/megatron/core/optimizer/"
  status=0
  routing "$unpatched" "$release" "$work/negative-$release.log" || status=$?
  if [[ $status != 1 ]] || ! tail -n 1 "$work/negative-$release.log" | grep -Eq '^[0-9]+ failed' ||
      tail -n 1 "$work/negative-$release.log" | grep -q 'error'; then
    cat "$work/negative-$release.log"
    echo "negative control broken for upstream $release: the routing tests must fail there" >&2
    exit 1
  fi
  echo "ok $release: $(basename "$wheel"): routing tests" \
    "$(tail -n 1 "$work/routing-$release.log" | grep -Eo '[0-9]+ passed'); on unpatched upstream" \
    "$release: $(tail -n 1 "$work/negative-$release.log" | grep -Eo '[0-9]+ failed') as expected" \
    "($((SECONDS - start)) s)"
done

echo "== tests: python -m pytest (against the default build, $(python -m pip show megatron-core | grep ^Version:))"
python -m pytest "$@"
