#!/usr/bin/env bash
# Installs everything from scratch into a fresh Python >= 3.12 venv and runs the checks:
#   mypy --strict on the subsystem, the build tools and the benchmark, the Sphinx docs with -W,
#   for every supported megatron-core release X: 'pip wheel .' composes X+stateadoption (the
#   patches apply with --fuzz=0), the routing tests pass against it and FAIL against unpatched
#   upstream X (negative control),
#   the test suite against the default build, on every CPU (pytest-xdist; GPU tests are reported
#   as skipped, with the reason, without CUDA + TE),
#   Megatron-LM's own lint checks (its black, isort, pylint and ruff settings and copyright line,
#   upstream/lint/) on every file the Megatron-LM series adds or changes: upstream/lint_series.py
#   fails on any finding the series introduces.
# Independent steps run side by side: every release is composed (and its unpatched upstream
# unpacked) while the requirements install (the default build's, read from its upstream wheel as
# setup.py reads them -- torch, once --, the tests' and the docs'); then the default release's
# wheel (the one 'pip install .' builds) and the example plugin install, and pytest runs in the
# foreground while mypy + the docs, the routing checks and the series' lint run in the background,
# each into its own log, printed after pytest. From there every step runs to the end; the last line
# names the failed ones. pip's cache is shared by all steps (pip's default).
# Usage: bash scripts/run-tests.sh [extra pytest args]
#   VENV=dir to choose the venv; JOBS=N pytest workers (default: the CPUs, at most 8; 0: none)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/find-python.sh
find_python
work=$(mktemp -d)
declare -A pids=()
kill_tree() {  # kill_tree PID: the process and all its descendants
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
cleanup() {
  local name
  for name in "${!pids[@]}"; do
    [[ -f $work/$name.status ]] || kill_tree "${pids[$name]}"  # still running
  done
  rm -rf "$work"
}
trap cleanup EXIT
began=$SECONDS
step() { echo "== [$((SECONDS - began)) s] $*"; }
# start NAME COMMAND...: run COMMAND in the background (errexit on), its output into
# $work/NAME.log and, when it ends, its exit status into $work/NAME.status
start() {
  local name=$1
  shift
  (
    set +e
    (set -e; "$@") > "$work/$name.log" 2>&1
    echo $? > "$work/$name.status.part" && mv "$work/$name.status.part" "$work/$name.status"
  ) &
  pids[$name]=$!
}
# finish NAME: wait until NAME ended (from any subshell), print its log, return its status
finish() {
  until [[ -f $work/$1.status ]]; do sleep 1; done
  cat "$work/$1.log"
  return "$(cat "$work/$1.status")"
}
failed=()

venv=${VENV:-$work/venv}
step "venv $venv ($("$PYTHON" --version))"
"$PYTHON" -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install -q --upgrade pip packaging  # packaging: build_tools' release list
mapfile -t releases < <(python -c 'from build_tools.releases import supported_versions as v
print(*v(), sep="\n")')
default=$(python -c 'from build_tools.releases import select_upstream_version as s; print(s())')
mkdir -p build/upstream

# compose RELEASE: 'pip wheel .' -> $work/wheels-RELEASE; the default release as 'pip install .'
# builds it (this tree, the environment's MCORE_UPSTREAM_*), the others each from a copy of the
# build inputs (setuptools writes its egg-info into the tree it builds; build/upstream shared).
# Then the release's build and its unpatched upstream (with this subsystem copied in) are
# installed into sites of their own, and the release's patches are dry-run against upstream.
compose() {
  local release=$1 source=. start=$SECONDS
  local build="$work/build-$release" unpatched="$work/upstream-$release" unset=()
  if [[ $release != "$default" ]]; then
    source="$work/src-$release" unset=(-u MCORE_UPSTREAM_WHEEL)
    mkdir -p "$source/build"
    cp -r setup.py pyproject.toml MANIFEST.in build_tools megatron patches "$source/"
    ln -s "$PWD/build/upstream" "$source/build/upstream"
  fi
  # the real build path: GNU patch --fuzz=0; any hunk that does not apply fails the build
  env "${unset[@]}" MCORE_UPSTREAM_VERSION="$release" \
    python -m pip wheel -q --no-deps "$source" -w "$work/wheels-$release"
  local wheel upstream_wheel patch_file applied
  wheel=$(ls "$work/wheels-$release"/*.whl)
  python -m pip install -q --no-deps --target "$build" "$wheel"
  upstream_wheel=$(python -c 'import sys; from pathlib import Path
from build_tools.upstream import ensure_upstream_wheel as e
print(e(Path("build/upstream"), sys.argv[1], environ={}))' "$release")
  python -m pip install -q --no-deps --target "$unpatched" "$upstream_wheel"
  for patch_file in $(python -c 'import sys; from pathlib import Path
from build_tools.patching import find_patches as f
print(*f(Path("patches"), sys.argv[1]))' "$release"); do  # the patches for this release
    applied=$(LC_ALL=C patch -p1 --fuzz=0 --dry-run --batch --forward -d "$unpatched" \
      -i "$PWD/$patch_file")
    echo "$release: $(basename "$patch_file") applies with --fuzz=0: $(echo "$applied" | tr '\n' ' ')"
  done
  cp -r megatron/core/optimizer/state_adoption "$unpatched/megatron/core/optimizer/"
  echo "$release: composed $(basename "$wheel") ($((SECONDS - start)) s)"
}

step "releases ${releases[*]}: composing each ('pip wheel .'), in the background"
for release in "$default" "${releases[@]}"; do
  [[ -n ${pids[compose-$release]:-} ]] || start "compose-$release" compose "$release"
done

# Meanwhile the requirements: the default build's (the upstream wheel's Requires-Dist, as
# setup.py derives them; torch among them), the tests' and the docs'.
step "install: the default build's requirements -r requirements/test.txt -r requirements/docs.txt"
python -c 'import sys; from pathlib import Path
from build_tools.requirements import requirements_from_metadata as r
from build_tools.upstream import ensure_upstream_wheel as e, read_wheel_metadata as m
print(*r(m(e(Path("build/upstream"), sys.argv[1]))).install_requires, sep="\n")' "$default" \
  > "$work/build-requirements.txt"
python -m pip install -q -r "$work/build-requirements.txt" -r requirements/test.txt \
  -r requirements/docs.txt
step "install: the default build ($default, 'pip wheel .' above) and the example plugin"
finish "compose-$default"
python -m pip install -q "$work/wheels-$default"/*.whl ./examples/te-precision-aware-adopter
python -m pip show megatron-core | grep -E '^(Name|Version):'

# the static checks, one after the other
static_checks() {
  echo "== mypy --strict"
  python -m mypy --cache-dir "$work/mypy-cache" megatron/core/optimizer/state_adoption \
    megatron/core/dist_checkpointing/in_place_merge.py \
    build_tools setup.py upstream/build_series.py upstream/make_gpu_bundle.py \
    scripts/device/pytest_outcomes.py upstream/lint_series.py
  echo "== mypy --strict: the resume benchmark (Megatron-Core, TE and TensorBoard as Any)"
  python -m mypy --cache-dir "$work/mypy-cache" --config-file benchmarks/mypy.ini \
    benchmarks/resume_benchmark
  echo "== docs: sphinx -W (warnings are errors)"
  python -m sphinx -W --keep-going -q -b html docs "$work/docs-html"
}

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
sys.exit(pytest.main(["-q", "tests/state_adoption/test_call_sites.py"]))' \
    "$1" "$2" > "$3" 2>&1
}
# route RELEASE: the routing tests pass against the composed RELEASE+stateadoption and fail (not
# error) against unpatched upstream RELEASE with this subsystem (negative control)
route() {
  local release=$1 start=$SECONDS status=0
  if ! routing "$work/build-$release" "$release+stateadoption" "$work/routing-$release.log"; then
    cat "$work/routing-$release.log"
    echo "the routing tests fail against the composed megatron-core $release+stateadoption" >&2
    return 1
  fi
  routing "$work/upstream-$release" "$release" "$work/negative-$release.log" || status=$?
  if [[ $status != 1 ]] || ! tail -n 1 "$work/negative-$release.log" | grep -Eq '^[0-9]+ failed' ||
      tail -n 1 "$work/negative-$release.log" | grep -q 'error'; then
    cat "$work/negative-$release.log"
    echo "negative control broken for upstream $release: the routing tests must fail there" >&2
    return 1
  fi
  echo "ok $release: $(basename "$work/wheels-$release"/*.whl): routing tests" \
    "$(tail -n 1 "$work/routing-$release.log" | grep -Eo '[0-9]+ passed'); on unpatched upstream" \
    "$release: $(tail -n 1 "$work/negative-$release.log" | grep -Eo '[0-9]+ failed') as expected" \
    "($((SECONDS - start)) s)"
}
routing_checks() {
  local release status=0
  for release in "${releases[@]}"; do
    [[ $release == "$default" ]] || finish "compose-$release" || return 1
    route "$release" || status=1
  done
  return $status
}

# Megatron-LM's lint on the series: the files it adds as they are here, the files it changes as
# the default release's upstream wheel (cached in build/upstream by the composition) with
# patches/*.patch applied, only findings the unpatched files lack counting; exit 1 on any. The
# tools run in a venv of their own with only requirements/lint.txt, as Megatron-LM's linting job
# has only its linting group (pylint's inference then stops at torch instead of reading it:
# faster, and what upstream's result comes from).
upstream_lint() {
  "$PYTHON" -m venv "$work/lint-venv"
  "$work/lint-venv/bin/python" -m pip install -q -r requirements/lint.txt
  python upstream/lint_series.py -v --tools-python "$work/lint-venv/bin/python"
}

step "mypy and docs, the routing checks of every release and the series' lint, in the background"
start static static_checks
start releases routing_checks
start lint upstream_lint

jobs=${JOBS:-$(nproc)}
(( jobs <= 8 )) || jobs=8
xdist=()
(( jobs == 0 )) || xdist=(-n "$jobs" --dist worksteal)
step "tests: python -m pytest ${xdist[*]} (against the default build, $(python -m pip show megatron-core | grep ^Version:))"
python -m pytest "${xdist[@]}" "$@" || failed+=(pytest)

step "mypy --strict, docs"
finish static || failed+=("mypy/docs")
step "releases: compose each; routing tests pass on it and fail on unpatched upstream"
finish releases || failed+=("releases")
step "upstream lint: python upstream/lint_series.py (Megatron-LM's settings, upstream/lint/)"
finish lint || failed+=("upstream lint")
if (( ${#failed[@]} )); then
  step "FAILED: ${failed[*]}"
  exit 1
fi
step "all passed"
