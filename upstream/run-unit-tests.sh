#!/usr/bin/env bash
# Runs Megatron-LM's optimizer unit tests from a snapshot, without and with our patch series, on
# 1 GPU (python -m pytest) and on 2 GPUs (python -m torch.distributed.run, as Megatron-LM's CI
# launches its unit tests), and compares the pass sets. For an offline GPU machine.
#
#   run-unit-tests.sh setup
#       install the wheels (TE and its deps from $TE_WHEELS, minus megatron_core; the extra test
#       deps from $EXTRA_WHEELS) into $WORK/site, offline, once per machine
#   run-unit-tests.sh run BRANCH VARIANT NGPU OUTDIR [GPUS] [PORT]
#       BRANCH main|dev, VARIANT without|with, NGPU 1|2; GPUS is CUDA_VISIBLE_DEVICES (default
#       0 or 0,1), PORT the rendezvous port (default 29500). Writes OUTDIR/BRANCH-VARIANT-NGPUgpu/
#   run-unit-tests.sh lanes OUTDIR SPEC...
#       run several SPEC=BRANCH:VARIANT:NGPU:GPUS:PORT concurrently (distinct GPUs and ports)
#   run-unit-tests.sh compare OUTDIR
#       for every BRANCH/NGPU with both variants: the same pass set, plus the new tests?
#       writes OUTDIR/compare-BRANCH-NGPUgpu.txt and OUTDIR/passed-*.txt; exit 1 if not
#
# Inputs (defaults relative to this repository): $MLM_DIR/megatron-lm-BRANCH.tar.gz (made by
# upstream/make_gpu_bundle.py; Megatron-LM's megatron/ and tests/unit_tests/ at the snapshot
# recorded in upstream/series.json, plus the series in upstream-series/), $TE_WHEELS
# (.gpu-mlm/te-wheels, else shared/gpu-wheels), $EXTRA_WHEELS (.gpu-mlm/wheels). Scratch: $WORK
# (/tmp/mlm-unit). $PYTEST_EXTRA is appended to pytest's arguments (e.g. --collect-only);
# $MLM_TESTS replaces the test paths (default: tests/unit_tests/optimizer,
# tests/unit_tests/test_optimizer.py, tests/unit_tests/dist_checkpointing/test_optimizer.py).
# pytest runs with the snapshot's own pyproject options, except --maxfail=1000000 (dev's addopts
# has -x) and --continue-on-collection-errors. Per-test timeout: $TEST_TIMEOUT seconds (default 180, pytest-timeout's thread method: a hung
# test ends the process; the run restarts after it, deselecting what already has an outcome,
# and records it as "timeout"). Known-flaky tests are deselected as Megatron-LM's CI does
# (-m "not flaky and not flaky_in_dev").
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/mlm-unit}
MLM_DIR=${MLM_DIR:-$repo/.gpu-mlm}
if [[ -z "${TE_WHEELS:-}" ]]; then
  TE_WHEELS=$repo/.gpu-mlm/te-wheels; [[ -d "$TE_WHEELS" ]] || TE_WHEELS=$repo/shared/gpu-wheels
fi
EXTRA_WHEELS=${EXTRA_WHEELS:-$repo/.gpu-mlm/wheels}
TEST_TIMEOUT=${TEST_TIMEOUT:-180}
MAX_RESTARTS=${MAX_RESTARTS:-6}
read -r -a TESTS <<< "${MLM_TESTS:-tests/unit_tests/optimizer tests/unit_tests/test_optimizer.py tests/unit_tests/dist_checkpointing/test_optimizer.py}"
# Keep NVLink multicast off (this machine's rule; also Megatron-LM's unit-test default).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

die() { echo "run-unit-tests.sh: $*" >&2; exit 2; }

cmd_setup() {
  local wheels=()
  for w in "$TE_WHEELS"/*.whl "$EXTRA_WHEELS"/*.whl; do
    [[ -e "$w" ]] || continue
    [[ "$(basename "$w")" == megatron_core-* ]] && continue   # the snapshot's megatron is tested
    wheels+=("$w")
  done
  ((${#wheels[@]})) || die "no wheels in $TE_WHEELS or $EXTRA_WHEELS"
  mkdir -p "$WORK"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" "${wheels[@]}"
  echo "installed ${#wheels[@]} wheels into $WORK/site"
  # tests/unit_tests/conftest.py downloads test data unless /opt/data has content; these tests
  # need none and the machine is offline.
  if [[ ! -d /opt/data ]] || [[ -z "$(ls -A /opt/data 2>/dev/null)" ]]; then
    mkdir -p /opt/data && touch /opt/data/.no-unit-test-data || true
  fi
  PYTHONPATH="$WORK/site" "$PY" -c 'import torch, pytest
print("torch", torch.__version__, "cuda devices", torch.cuda.device_count(), "pytest", pytest.__version__)
import transformer_engine.pytorch' || echo "WARNING: transformer_engine does not import here" >&2
}

# The last outcome line of each test, the worst one if a test has several (e.g. teardown error).
final_outcomes() {  # rank file -> "outcome<TAB>nodeid" sorted by nodeid
  awk -F'\t' '
    $1 ~ /^(COLLECTED|COLLECT_ERROR|COLLECT_SKIP|START|SESSION_END)$/ { next }
    { rank["passed"]=1; rank["xfailed"]=1; rank["xpassed"]=2; rank["skipped"]=1;
      rank["failed"]=3; rank["error"]=4; rank["timeout"]=5;
      if (!($2 in o) || rank[$1] > rank[o[$2]]) o[$2] = $1 }
    END { for (t in o) print o[t] "\t" t }' "$1" | sort -t$'\t' -k2
}

count_lines() { if [[ -f "$1" ]]; then wc -l < "$1"; else echo 0; fi; }

cmd_run() {
  local branch=$1 variant=$2 ngpu=$3 outdir=$4
  local gpus=${5:-$( ((ngpu == 1)) && echo 0 || echo 0,1 )} port=${6:-29500}
  [[ "$branch" =~ ^(main|dev)$ && "$variant" =~ ^(without|with)$ && "$ngpu" =~ ^[12]$ ]] ||
    die "usage: run main|dev without|with 1|2 OUTDIR [GPUS] [PORT]"
  local bundle="$MLM_DIR/megatron-lm-$branch.tar.gz" name="$branch-$variant-${ngpu}gpu"
  [[ -f "$bundle" ]] || die "missing $bundle"
  [[ -d "$WORK/site" ]] || die "run setup first"
  local tree="$WORK/tree-$name" out="$outdir/$name"
  rm -rf "$tree" "$out"; mkdir -p "$tree" "$out"
  out="$(cd "$out" && pwd)"
  tar xzf "$bundle" -C "$tree"
  cp "$tree/SNAPSHOT_COMMIT" "$out/"
  if [[ "$variant" == with ]]; then
    (cd "$tree" && git apply --verbose upstream-series/*.patch) > "$out/apply.log" 2>&1 ||
      { cat "$out/apply.log"; die "the series does not apply"; }
  fi
  local timeout_args=()
  if PYTHONPATH="$WORK/site" "$PY" -c 'import pytest_timeout' 2>/dev/null; then
    timeout_args=(--timeout="$TEST_TIMEOUT" --timeout-method=thread)
  fi
  local start=$SECONDS attempt=0 status=0 lines_before lines_after
  while :; do
    lines_before=$(count_lines "$out/outcomes/rank0.tsv")
    local deselect=()
    if [[ -f "$out/outcomes/rank0.tsv" ]]; then
      # A START without an outcome is the test that hung or crashed the process.
      local hung
      hung=$(awk -F'\t' '$1=="START"{s=$2; next} $2==s{s=""} END{print s}' "$out/outcomes/rank0.tsv")
      if [[ -n "$hung" ]]; then
        for f in "$out"/outcomes/rank*.tsv; do printf 'timeout\t%s\t-\n' "$hung" >> "$f"; done
      fi
      while IFS=$'\t' read -r _ nodeid; do deselect+=(--deselect "$nodeid"); done \
        < <(final_outcomes "$out/outcomes/rank0.tsv")
    fi
    # --maxfail overrides dev's addopts "-x": at 1 or 2 GPUs many tests written for 8 fail, and
    # the comparison needs every outcome.
    local pytest_args=(-p pytest_outcomes -p no:cacheprovider -rA --continue-on-collection-errors
                       --maxfail=1000000
                       -m "not flaky and not flaky_in_dev" "${timeout_args[@]}" ${PYTEST_EXTRA:-}
                       "${deselect[@]}" "${TESTS[@]}")
    echo "== $name attempt $attempt (${#deselect[@]} deselect args) $(date -u +%T)" >> "$out/pytest.log"
    set +e
    (
      cd "$tree"
      export PYTHONPATH="$tree:$repo/scripts/device:$WORK/site" CUDA_VISIBLE_DEVICES="$gpus"
      export MASTER_ADDR=localhost MASTER_PORT="$port" PYTEST_OUTCOMES="$out/outcomes/rank{rank}.tsv"
      # tmp_path_dist_ckpt is <pytest temp root>/tmp_dist_ckpt, shared by every pytest of the
      # user: concurrent runs need their own temp root (a run's ranks share it).
      export TMPDIR="$WORK/tmp-$name"; rm -rf "$TMPDIR"; mkdir -p "$TMPDIR"
      if ((ngpu == 1)); then
        "$PY" -m pytest "${pytest_args[@]}"
      else
        export PYTEST_OUTCOMES_EXIT_ZERO=1
        "$PY" -m torch.distributed.run --nproc-per-node 2 --master-addr localhost \
          --master-port "$port" --log-dir "$out/torchrun-$attempt" --redirects 3 --tee 3 \
          -m pytest "${pytest_args[@]}"
      fi
    ) >> "$out/pytest.log" 2>&1
    status=$?
    set -e
    lines_after=$(count_lines "$out/outcomes/rank0.tsv")
    if grep -q '^SESSION_END' "$out/outcomes/rank0.tsv" 2>/dev/null; then break; fi
    if ((attempt >= MAX_RESTARTS || lines_after == lines_before)); then
      echo "== $name: stopped after attempt $attempt without finishing (see pytest.log)" >> "$out/pytest.log"
      break
    fi
    attempt=$((attempt + 1))
  done
  mkdir -p "$out/outcomes"
  for f in "$out"/outcomes/rank*.tsv; do
    [[ -e "$f" ]] || continue
    final_outcomes "$f" > "$out/results-$(basename "$f" .tsv).txt"
  done
  {
    echo "$name: snapshot $(cat "$out/SNAPSHOT_COMMIT"), ${ngpu} GPU(s) [$gpus], exit $status," \
         "restarts $attempt, $((SECONDS - start)) s"
    for f in "$out"/results-rank*.txt; do
      echo "  $(basename "$f" .txt): $(cut -f1 "$f" | sort | uniq -c | awk '{printf "%s %s, ", $1, $2}')"
    done
  } | tee "$out/summary.txt"
}

cmd_lanes() {
  local outdir=$1; shift
  mkdir -p "$outdir"
  local pids=()
  for spec in "$@"; do
    IFS=: read -r branch variant ngpu gpus port <<< "$spec"
    cmd_run "$branch" "$variant" "$ngpu" "$outdir" "$gpus" "$port" > "$outdir/lane-$branch-$variant-${ngpu}gpu.log" 2>&1 &
    pids+=($!)
  done
  local failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  cat "$outdir"/*/summary.txt 2>/dev/null || true
  return $failed
}

# A test passes on NGPU GPUs if it passed on every rank.
passed_on_all_ranks() {  # run dir -> sorted nodeids
  local dir=$1 n
  n=$(ls "$dir"/results-rank*.txt | wc -l)
  cat "$dir"/results-rank*.txt | awk -F'\t' '$1=="passed"{print $2}' | sort | uniq -c |
    awk -v n="$n" '$1==n{print $2}'
}

cmd_compare() {
  local outdir=$1 rc=0
  for without in "$outdir"/*-without-*gpu; do
    [[ -d "$without" ]] || continue
    local name; name=$(basename "$without")
    local with="$outdir/${name/-without-/-with-}" key="${name/-without/}"
    [[ -d "$with" ]] || continue
    passed_on_all_ranks "$without" > "$outdir/passed-$name.txt"
    passed_on_all_ranks "$with" > "$outdir/passed-${name/-without-/-with-}.txt"
    local report="$outdir/compare-$key.txt"
    {
      echo "$key: without $(wc -l < "$outdir/passed-$name.txt") passed," \
           "with $(wc -l < "$outdir/passed-${name/-without-/-with-}.txt") passed"
      local lost new_other new_ours
      lost=$(comm -23 "$outdir/passed-$name.txt" "$outdir/passed-${name/-without-/-with-}.txt")
      new_ours=$(comm -13 "$outdir/passed-$name.txt" "$outdir/passed-${name/-without-/-with-}.txt" |
        grep -E 'test_state_adoption' || true)
      new_other=$(comm -13 "$outdir/passed-$name.txt" "$outdir/passed-${name/-without-/-with-}.txt" |
        grep -vE 'test_state_adoption' || true)
      echo "passed without the series but not with it: $(grep -c . <<< "$lost" || true)"
      [[ -n "$lost" ]] && sed 's/^/  - /' <<< "$lost"
      echo "passed only with the series, new tests: $(grep -c . <<< "$new_ours" || true)"
      [[ -n "$new_ours" ]] && sed 's/^/  + /' <<< "$new_ours"
      echo "passed only with the series, existing tests: $(grep -c . <<< "$new_other" || true)"
      [[ -n "$new_other" ]] && sed 's/^/  + /' <<< "$new_other"
      local new_not_passed
      new_not_passed=$(cat "$with"/results-rank*.txt | awk -F'\t' '$1!="passed" && $2 ~ /test_state_adoption/ {print $1" "$2}' | sort -u)
      echo "new tests not passed on some rank: $(grep -c . <<< "$new_not_passed" || true)"
      [[ -n "$new_not_passed" ]] && sed 's/^/  ! /' <<< "$new_not_passed"
      if [[ -z "$lost" && -z "$new_other" ]]; then echo "RESULT: same pass set plus the new tests"
      else echo "RESULT: pass sets differ"; fi
    } | tee "$report"
    grep -q '^RESULT: same' "$report" || rc=1
  done
  return $rc
}

case "${1:-}" in
  setup) shift; cmd_setup "$@" ;;
  run) shift; cmd_run "$@" ;;
  lanes) shift; cmd_lanes "$@" ;;
  compare) shift; cmd_compare "$@" ;;
  *) sed -n '2,32p' "$0"; exit 2 ;;
esac
