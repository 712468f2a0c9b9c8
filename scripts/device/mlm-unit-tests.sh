#!/usr/bin/env bash
# Megatron-LM's own unit tests for checkpointing and the optimizers, at a pinned ref (core_r0.19.0),
# once against upstream megatron-core 0.19.2 and once against this repository's build of 0.19.2,
# with everything else identical; writes each side's list of test outcomes and their diff (empty
# when the build changes no outcome).
#
# Usage: bash scripts/device/mlm-unit-tests.sh stage [MEGATRON_LM_GIT_DIR]   # here, fills .gpu/
#        bash scripts/device/mlm-unit-tests.sh run                           # on the GPU machine
#
# stage: copies ../shared/gpu-wheels to .gpu/wheels (TE 2.20.2 and its dependencies, upstream
#   megatron-core 0.19.2), builds this repository's wheel on that same upstream wheel into
#   .gpu/dist-0.19.2, and writes .gpu/mlm-unit/: the mock wheel (the one test dependency the GPU
#   machine lacks) and megatron-lm-tests-$REF.tar.gz, Megatron-LM's megatron/ without
#   megatron/core, the four top-level modules the tests import, pyproject.toml (pytest's options
#   and markers) and the test folders below. MEGATRON_LM_GIT_DIR defaults to
#   /work/.mirror/NVIDIA+Megatron-LM/repo, REF (environment) to core_r0.19.0, BUILD_PYTHON (a
#   Python >= 3.12 with pip, for the build) to python. Carry
#   .gpu/wheels, .gpu/dist-0.19.2 and .gpu/mlm-unit.
#
# run: installs TE (/tmp/te, kept between calls), each megatron-core into its own fresh site
#   ($WORK/mc-upstream, $WORK/mc-build) and mock ($WORK/test-deps), unpacks the tests into one
#   tree per side, and runs `python -m pytest` in each tree (both sides at once, one GPU, one
#   process each; SEQUENTIAL=1 runs one after the other). PYTHONPATH is SITE:/tmp/te:test-deps:
#   TREE; the tree has no megatron/core, so megatron.core comes from SITE and megatron.training
#   from the ref (checked: a side whose megatron.core is not its site's stops the run).
#   pytest takes the ref's pyproject options plus -v --continue-on-collection-errors
#   -p no:cacheprovider, deselects only by the markers Megatron-LM's CI deselects by
#   (-m "not flaky and not flaky_in_dev"), and stops a test after TEST_TIMEOUT s (default 120,
#   pytest-timeout's thread method when installed: the process ends, the side restarts with what
#   has an outcome deselected, and that test is recorded as "timeout"). Both sides end
#   RUN_SECONDS (default 530) after the run started, installs included, whatever is left
#   (SEQUENTIAL=1: the first side gets half of what is left after the installs); collected
#   tests that never ran are "notrun", a module skipped whole is "MODULE skipped".
#   Results: $OUT/mlm-unit-tests.tgz (repacked every 30 s) with outcomes-upstream.txt and
#   outcomes-build.txt (sorted "test_id outcome" lines: passed, failed, error, skipped, xfailed,
#   xpassed, timeout, crashed, notrun; a module that failed to collect is "MODULE error"),
#   outcomes.diff (diff -u of the two; empty = identical), summary.txt, machine.txt, the raw
#   event files and the tail of each pytest log. Exit 0 iff both sides finished and the lists are
#   identical.
#   Environment: PYTEST_EXTRA (extra pytest arguments, e.g. --collect-only), MLM_TESTS (test
#   paths relative to the tree, replacing the default set), TEST_TIMEOUT, RUN_SECONDS,
#   SEQUENTIAL, PYTHON (python3), WORK (/tmp/mlm-unit), TE_SITE (/tmp/te), EXTRA_PYTHONPATH
#   (added to both sides after the test dependencies), CUDA_VISIBLE_DEVICES (0).
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
REF=${REF:-core_r0.19.0}
PY=${PYTHON:-python3}
bundle_name=megatron-lm-tests-$REF.tar.gz

usage() {
  echo "usage: bash scripts/device/mlm-unit-tests.sh stage [MEGATRON_LM_GIT_DIR] | run" >&2
  exit 2
}
die() { echo "mlm-unit-tests.sh: $*" >&2; exit 2; }

# What the tree holds besides megatron/ (minus megatron/core): the test paths that run and what
# they import.
TREE_PATHS=(
  pyproject.toml gpt_builders.py hybrid_builders.py model_provider.py pretrain_gpt.py
  tests/__init__.py tests/test_utils/python_scripts/download_unit_tests_dataset.py
  tests/unit_tests/__init__.py tests/unit_tests/conftest.py tests/unit_tests/test_utilities.py
  tests/unit_tests/test_utils.py tests/unit_tests/test_layer_wise_optimizer.py
  tests/unit_tests/dist_checkpointing tests/unit_tests/optimizer tests/unit_tests/distributed
  'tests/unit_tests/test_optimizer*.py'
)
# The tests that run: dist_checkpointing/ whole, test_optimizer*.py, optimizer/ whole, and the
# distributed optimizer's tests (its parameter layouts, the layer-wise one, its buffers and grad
# sync, Megatron-FSDP under it).
DEFAULT_TESTS=(
  tests/unit_tests/dist_checkpointing
  'tests/unit_tests/test_optimizer*.py'
  tests/unit_tests/optimizer
  tests/unit_tests/test_layer_wise_optimizer.py
  tests/unit_tests/distributed/test_param_layout.py
  tests/unit_tests/distributed/test_layer_wise_param_layout.py
  tests/unit_tests/distributed/test_param_and_grad_buffer.py
  tests/unit_tests/distributed/test_grad_sync_with_expert_parallel.py
  tests/unit_tests/distributed/mfsdp_v1/test_mcore_fully_sharded_data_parallel.py
)

cmd_stage() {
  set -e
  local mlm_git=${1:-/work/.mirror/NVIDIA+Megatron-LM/repo}
  local commit
  commit=$(git --git-dir "$mlm_git" rev-parse --verify "$REF^{commit}") || die "no $REF in $mlm_git"
  [[ -d ../shared/gpu-wheels ]] || die "no ../shared/gpu-wheels"
  local build_py=${BUILD_PYTHON:-python}
  "$build_py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' ||
    die "the build needs Python >= 3.12 with pip: set BUILD_PYTHON (e.g. a 3.12 venv's python)"
  mkdir -p .gpu
  rm -rf .gpu/wheels .gpu/dist-0.19.2 .gpu/mlm-unit
  cp -r ../shared/gpu-wheels .gpu/wheels && chmod -R u+w .gpu/wheels
  local upstream_wheel
  upstream_wheel=$(ls .gpu/wheels/megatron_core-0.19.2-*.whl | head -n 1)
  MCORE_UPSTREAM_WHEEL=$repo/$upstream_wheel "$build_py" -m pip wheel -q --no-cache-dir --no-deps -w .gpu/dist-0.19.2 .
  mkdir -p .gpu/mlm-unit
  "$build_py" -m pip download -q --no-deps --only-binary=:all: -d .gpu/mlm-unit mock==5.2.0
  local tmp
  tmp=$(mktemp -d)
  mkdir "$tmp/tree"
  git --git-dir "$mlm_git" archive "$commit" -- megatron ':(exclude)megatron/core' \
    "${TREE_PATHS[@]}" | tar -x -C "$tmp/tree"
  [[ ! -e $tmp/tree/megatron/core && ! -e $tmp/tree/megatron/__init__.py ]] ||
    die "the tree must have neither megatron/core nor megatron/__init__.py"
  echo "$REF $commit" > "$tmp/tree/MEGATRON_LM_REF"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$tmp/tree" -cf - . |
    gzip -n -9 > ".gpu/mlm-unit/$bundle_name"
  rm -rf "$tmp"
  local w
  for w in .gpu/wheels/megatron_core-*.whl .gpu/dist-0.19.2/*.whl; do
    if unzip -Z1 "$w" | grep -x 'megatron/__init__.py' > /dev/null; then die "$w has megatron/__init__.py"; fi
  done
  ls -l .gpu/dist-0.19.2 .gpu/mlm-unit
  du -shc .gpu/wheels .gpu/dist-0.19.2 .gpu/mlm-unit
  local kib
  kib=$(du -sck .gpu/wheels .gpu/dist-0.19.2 .gpu/mlm-unit | tail -n 1 | cut -f1)
  ((kib < 60 * 1024)) || die "the carried paths take ${kib} KiB (limit 64 MiB in all)"
  echo "carry: .gpu/wheels .gpu/dist-0.19.2 .gpu/mlm-unit"
}

# Events file -> "nodeid<TAB>outcome" for every test, sorted by nodeid: the worst outcome a test
# has (a teardown error outranks its call's pass), "UNRUN" for collected tests without one, and
# each module that failed to collect as an error.
final_outcomes() {  # EVENTS UNRUN_LABEL
  awk -F'\t' -v unrun="$2" '
    BEGIN { r["passed"]=1; r["skipped"]=1; r["xfailed"]=1; r["xpassed"]=2; r["failed"]=3;
            r["error"]=4; r["crashed"]=5; r["timeout"]=5 }
    $1 == "COLLECTED" { seen[$2]=1; next }
    $1 == "COLLECT_ERROR" { o[$2]="error"; next }
    $1 == "COLLECT_SKIP" { if (!($2 in o)) o[$2]="skipped"; next }
    $1 == "START" || $1 == "SESSION_END" { next }
    { if (!($2 in o) || r[$1] > r[o[$2]]) o[$2]=$1 }
    END { for (t in seen) if (!(t in o)) o[t]=unrun
          for (t in o) print t "\t" o[t] }' "$1" | LC_ALL=C sort -t$'\t' -k1,1
}

# One side: pytest in its own tree against its own site, restarted after a test that ends the
# process, until the session ends or the deadline has passed.
run_side() {  # SIDE SITE PORT DEADLINE (in $SECONDS)
  local side=$1 site=$2 port=$3 deadline=$4
  local tree=$WORK/tree-$side events=$results/events-$side.tsv log=$WORK/pytest-$side.log
  local side_start=$SECONDS attempt=0 rc=0 before after
  : > "$events"; : > "$log"
  while :; do
    local remaining=$((deadline - SECONDS))
    ((remaining > 15)) || { echo "== $side: out of time before attempt $attempt" >> "$log"; break; }
    local deselect=()
    while IFS=$'\t' read -r nodeid _; do deselect+=(--deselect "$nodeid"); done \
      < <(awk -F'\t' '$1 != "COLLECTED" && $1 != "START" && $1 != "SESSION_END" &&
                      $1 != "COLLECT_ERROR" && $1 != "COLLECT_SKIP" {print $2 "\t"}' "$events")
    before=$(wc -l < "$events")
    echo "== $side attempt $attempt $(date -u +%T), $((${#deselect[@]} / 2)) done tests deselected, ${remaining} s left" >> "$log"
    (
      cd "$tree" || exit 2
      export PYTHONPATH="$site:$TE_SITE:$WORK/test-deps:$WORK/plugin${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}:$tree"
      export PYTEST_OUTCOMES=$events MASTER_PORT=$port TMPDIR=$WORK/tmp-$side
      timeout -k 15 "$remaining" "$PY" -m pytest "${pytest_args[@]}" "${deselect[@]}" "${tests[@]}"
    ) >> "$log" 2>&1
    rc=$?
    echo "== $side attempt $attempt exit $rc $(date -u +%T)" >> "$log"
    grep -q '^SESSION_END' "$events" && break
    # The process ended inside a test: that test gets "timeout" (the per-test limit or the
    # side's deadline) or "crashed", and the side goes on without it.
    local current
    current=$(awk -F'\t' '$1 == "START" {s=$2; next} $2 == s {s=""} END {print s}' "$events")
    if [[ -n $current ]]; then
      local what=crashed
      if ((rc == 124 || rc == 137)) || sed -n "/^== $side attempt $attempt /,\$p" "$log" | grep -q '^+* Timeout +*$'; then
        what=timeout
      fi
      printf '%s\t%s\t-\n' "$what" "$current" >> "$events"
    fi
    after=$(wc -l < "$events")
    ((rc != 124 && rc != 137)) || break
    ((after > before)) || { echo "== $side: attempt $attempt made no progress" >> "$log"; break; }
    attempt=$((attempt + 1))
  done
  final_outcomes "$events" "$unrun" |
    awk -F'\t' '{print $1 " " $2}' > "$results/outcomes-$side.txt"
  local finished=no
  grep -q '^SESSION_END' "$events" && finished=yes
  printf '%s: finished %s, attempts %d, last exit %d, %d s; %s\n' "$side" "$finished" \
    "$((attempt + 1))" "$rc" "$((SECONDS - side_start))" \
    "$(awk '{print $NF}' "$results/outcomes-$side.txt" | sort | uniq -c | awk '{printf "%s %s, ", $1, $2}')" \
    > "$results/summary-$side.txt"
  tail -n 3000 "$log" > "$results/pytest-$side.log.tail"
}

pack() {
  tar -czf "$out/mlm-unit-tests.tgz.part" -C "$results" . 2>/dev/null &&
    mv "$out/mlm-unit-tests.tgz.part" "$out/mlm-unit-tests.tgz"
}

cmd_run() {
  WORK=${WORK:-/tmp/mlm-unit} TE_SITE=${TE_SITE:-/tmp/te}
  TEST_TIMEOUT=${TEST_TIMEOUT:-120} RUN_SECONDS=${RUN_SECONDS:-530}
  out=${OUT:-/tmp/out} results=$WORK/results
  local start=$SECONDS
  local tarball=.gpu/mlm-unit/$bundle_name w
  [[ -f $tarball ]] || die "missing $tarball (run stage here first, carry .gpu/mlm-unit)"
  for w in .gpu/wheels/install.sh .gpu/wheels/megatron_core-0.19.2-*.whl .gpu/dist-0.19.2/*.whl \
           .gpu/mlm-unit/mock-*.whl; do
    [[ -f $w ]] || die "missing $w"
  done
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONHASHSEED=0
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} MASTER_ADDR=localhost
  export WORLD_SIZE=1 RANK=0 LOCAL_RANK=0
  # NVLink multicast stays off (this machine's rule; Megatron-LM's conftest sets the first too).
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  rm -rf "$WORK" && mkdir -p "$WORK/plugin" "$results" "$out" || die "cannot create $WORK"
  if [[ ! -f $TE_SITE/.done ]]; then
    SKIP=megatron_core bash .gpu/wheels/install.sh "$TE_SITE" > /dev/null && touch "$TE_SITE/.done" ||
      die "TE install failed"
  fi
  local pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --target)
  "${pip[@]}" "$WORK/mc-upstream" .gpu/wheels/megatron_core-0.19.2-*.whl &&
    "${pip[@]}" "$WORK/mc-build" .gpu/dist-0.19.2/*.whl &&
    "${pip[@]}" "$WORK/test-deps" .gpu/mlm-unit/mock-*.whl || die "install failed"
  cp scripts/device/pytest_outcomes.py "$WORK/plugin/"
  local side
  for side in upstream build; do
    mkdir -p "$WORK/tree-$side" "$WORK/tmp-$side" && tar -xzf "$tarball" -C "$WORK/tree-$side" ||
      die "cannot unpack $tarball"
  done
  # tests/unit_tests/conftest.py downloads test data unless /opt/data has content; these tests
  # read none and the machine is offline.
  if [[ -z $(ls -A /opt/data 2>/dev/null) ]]; then
    mkdir -p /opt/data 2>/dev/null && touch /opt/data/.no-unit-test-data 2>/dev/null ||
      echo "note: /opt/data is empty and not writable; conftest will try to download and fail" >&2
  fi

  tests=()
  local t
  read -r -a requested <<< "${MLM_TESTS:-${DEFAULT_TESTS[*]}}"
  for t in "${requested[@]}"; do
    # Globs are expanded in the tree.
    local matches=()
    mapfile -t matches < <(cd "$WORK/tree-upstream" && compgen -G "$t")
    ((${#matches[@]})) || die "no test path $t in the tree"
    tests+=("${matches[@]}")
  done
  local marker=()
  if grep -q '"flaky:' "$WORK/tree-upstream/pyproject.toml" && grep -q '"flaky_in_dev:' "$WORK/tree-upstream/pyproject.toml"; then
    marker=(-m "not flaky and not flaky_in_dev")
  fi
  local timeout_args=()
  if PYTHONPATH=$TE_SITE${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} "$PY" -c 'import pytest_timeout' 2>/dev/null; then
    timeout_args=(--timeout="$TEST_TIMEOUT" --timeout-method=thread)
  fi
  local extra=()
  read -r -a extra <<< "${PYTEST_EXTRA:-}"
  pytest_args=(-p pytest_outcomes -p no:cacheprovider -v --continue-on-collection-errors
               "${marker[@]}" "${timeout_args[@]}" "${extra[@]}")
  unrun=notrun
  [[ " ${extra[*]} " == *" --collect-only "* || " ${extra[*]} " == *" --co "* ]] && unrun=collected

  # Which megatron.core, megatron.training and TE each side imports, from its tree as pytest does.
  {
    echo "Megatron-LM $(cat "$WORK/tree-upstream/MEGATRON_LM_REF")"
    echo "this repository: $(git log --oneline -1 2>/dev/null)"
    git status --short 2>/dev/null | head -20
    nvidia-smi -L 2>&1 | head -4
    echo "python: $("$PY" -VV 2>&1)"
    echo "pytest arguments: ${pytest_args[*]}"
    echo "tests: ${tests[*]}"
    echo "per-test timeout: ${timeout_args[*]:-(pytest-timeout not installed)}; sides end ${RUN_SECONDS} s after the start"
    echo "installs and unpacking: $((SECONDS - start)) s"
  } > "$results/machine.txt"
  local bad=0
  for side in upstream build; do
    local site=$WORK/mc-$side info
    info=$(cd "$WORK/tree-$side" && PYTHONPATH="$site:$TE_SITE:$WORK/test-deps${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}:$WORK/tree-$side" "$PY" -W ignore -c '
import importlib.metadata as md, sys
import megatron.core as c, megatron.training as t
print("megatron.core", c.__file__, md.version("megatron-core"))
print("megatron.training", t.__file__)
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count())
try:
    import transformer_engine as te
    print("transformer_engine", te.__version__, te.__file__)
except Exception as e:
    print("transformer_engine does not import:", type(e).__name__, e)
' 2>&1)
    printf '%s:\n%s\n' "$side" "$(sed 's/^/  /' <<< "$info")" >> "$results/machine.txt"
    grep -q "^megatron.core $site/megatron/core/" <<< "$info" &&
      grep -q "^megatron.training $WORK/tree-$side/megatron/training/" <<< "$info" || bad=1
  done
  cat "$results/machine.txt"
  ((bad == 0)) || { pack; die "a side does not import megatron.core from its own site (machine.txt)"; }

  ( while sleep 30; do pack; done ) &
  local packer=$!
  local deadline=$((start + RUN_SECONDS))
  if [[ ${SEQUENTIAL:-0} == 1 ]]; then
    run_side upstream "$WORK/mc-upstream" 29510 $((SECONDS + (deadline - SECONDS) / 2))
    run_side build "$WORK/mc-build" 29520 "$deadline"
  else
    run_side upstream "$WORK/mc-upstream" 29510 "$deadline" &
    local first=$!
    run_side build "$WORK/mc-build" 29520 "$deadline"
    wait "$first"
  fi
  kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null
  diff -u --label outcomes-upstream.txt --label outcomes-build.txt "$results/outcomes-upstream.txt" \
    "$results/outcomes-build.txt" > "$results/outcomes.diff"
  local same=$? complete=yes
  cat "$results/summary-upstream.txt" "$results/summary-build.txt" | grep -q 'finished no' && complete=no
  {
    cat "$results/summary-upstream.txt" "$results/summary-build.txt"
    if ((same == 0)) && [[ $complete == yes ]]; then
      echo "IDENTICAL: $(wc -l < "$results/outcomes-upstream.txt") test outcomes, outcomes.diff is empty"
    elif ((same == 0)); then
      echo "IDENTICAL BUT INCOMPLETE: $(wc -l < "$results/outcomes-upstream.txt") test outcomes, outcomes.diff is empty, a side did not finish (notrun)"
    else
      echo "DIFFERENT: $(grep -c '^[-+][^-+]' "$results/outcomes.diff") changed lines in outcomes.diff"
    fi
    echo "total: $((SECONDS - start)) s"
  } | tee "$results/summary.txt"
  rm -f "$results/summary-upstream.txt" "$results/summary-build.txt"
  head -n 60 "$results/outcomes.diff"
  pack
  ((same == 0)) && [[ $complete == yes ]]
}

case "${1:-}" in
  stage) shift; cmd_stage "$@" ;;
  run) shift; (($# == 0)) || usage; cmd_run ;;
  *) usage ;;
esac
