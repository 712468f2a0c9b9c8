#!/usr/bin/env bash
# The multi-GPU runs, on one offline machine with 2 H200s (device kind nvidia-h200-x2; with 4,
# nvidia-h200-x4, the lanes get a pair each), as concurrent lanes; everything lands in
# $OUT/batch-<N>.tgz. Memory peaks are per process, so lanes sharing a GPU do not disturb them.
#   bash scripts/device/gpu-batch.sh 1   # the benchmark on 2 ranks (DP 2: dp-reshardable,
#                                        # fully-reshardable, moe; TP 2 and EP 2 through
#                                        # pretrain_gpt.py arguments), the GPU tests (one GPU and
#                                        # the 2-rank test), Megatron-LM's unit tests of main
#   bash scripts/device/gpu-batch.sh 2   # Megatron-LM's unit tests of dev
# (One GPU: scripts/device/megatron-lm-suite.sh and megatron-lm-client.sh.)
# Needs .gpu/ from scripts/device/make-bundle.sh plus .gpu/mlm-client (see megatron-lm-suite.sh).
# LANE_SECONDS bounds every lane (default 530).
set -uo pipefail
cd "$(dirname "$0")/../.."
batch=$1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
limit=${LANE_SECONDS:-530}
res=/tmp/res-$batch && rm -rf "$res" && mkdir -p "$res"
out=${OUT:-/tmp/out} && mkdir -p "$out"
[[ -f /tmp/te/.done ]] || { SKIP=megatron_core bash .gpu/wheels/install.sh /tmp/te > /dev/null && touch /tmp/te/.done; }
site() {  # site DIR WHEEL...
  [[ -f "$1/.done" ]] || { python3 -m pip install -q --no-index --no-deps --no-compile --target "$1" "${@:2}" && touch "$1/.done"; }
}
site /tmp/mc-upstream .gpu/wheels/megatron_core-0.19.2-*.whl
site /tmp/mc-build .gpu/dist-0.19.2/*.whl
site /tmp/mc-plugin .gpu/dist-0.19.2/*.whl .gpu/plugin/*.whl
mkdir -p /tmp/megatron-lm && tar -xzf .gpu/mlm-client/megatron-lm-core_r0.19.0.tar.gz -C /tmp/megatron-lm
export PYTHONPATH=/tmp/te
ngpu=$(nvidia-smi -L | wc -l)
if ((ngpu >= 4)); then pair_a=0,1 pair_b=2,3 g1=1 g3=3; else pair_a=0,1 pair_b=0,1 g1=1 g3=1; fi
{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__)'; git log --oneline -1; } > "$res/machine.txt" 2>&1

bench() {  # bench NAME GPUS ARGS...: one benchmark invocation on 2 ranks with --check
  local name=$1 gpus=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" python3 -m benchmarks.resume_benchmark \
    --megatron-lm /tmp/megatron-lm --upstream /tmp/mc-upstream --build /tmp/mc-build --check \
    --nproc-per-node 2 --work-dir "/tmp/work-$batch-$name" --json-out "$res/$name.json" \
    --markdown-out "$res/$name.md" "$@" > "$res/$name.log" 2>&1
  echo "$name exit $?" >> "$res/exits.txt"
}
lane() { ( "$@" ) & }
mlm() {  # mlm BRANCH: the four variants of Megatron-LM's unit tests, without and with our series
  MLM_DIR=.gpu/mlm TE_WHEELS=.gpu/wheels EXTRA_WHEELS=.gpu/mlm-wheels WORK=/tmp/mlm-unit \
    TEST_TIMEOUT=120 bash upstream/run-unit-tests.sh setup > "$res/mlm-setup-$1.log" 2>&1
  MLM_DIR=.gpu/mlm TE_WHEELS=.gpu/wheels EXTRA_WHEELS=.gpu/mlm-wheels WORK=/tmp/mlm-unit \
    TEST_TIMEOUT=120 timeout "$limit" bash upstream/run-unit-tests.sh lanes "$res/mlm" \
    "$1:without:2:$pair_a:29500" "$1:with:2:$pair_b:29510" "$1:without:1:$g1:29520" "$1:with:1:$g3:29530" \
    > "$res/mlm-$1.log" 2>&1
}
gpu_tests() {
  PYTHONPATH=/tmp/mc-plugin:/tmp/te CUDA_VISIBLE_DEVICES=$1 timeout "$limit" python3 -m pytest tests/gpu \
    -q -rA -p no:cacheprovider --ignore=tests/gpu/test_multirank_gpu.py > "$res/gpu-tests.log" 2>&1
  PYTHONPATH=/tmp/mc-build:/tmp/te CUDA_VISIBLE_DEVICES=$2 timeout "$limit" python3 -m torch.distributed.run \
    --standalone --nproc-per-node 2 -m pytest tests/gpu/test_multirank_gpu.py -q -rA -p no:cacheprovider \
    > "$res/gpu-tests-multirank.log" 2>&1
}
size_args() { python3 -c 'from benchmarks.resume_benchmark.configs import SIZES; print(*SIZES["small"])'; }

case $batch in
1)
  lane bench dp2 "$pair_a" --configs dp-reshardable,fully-reshardable,moe --size small
  # shellcheck disable=SC2046
  lane eval 'bench tp2 "$pair_b" -- $(size_args) --bf16 --use-distributed-optimizer --tensor-model-parallel-size 2; bench ep2 "$pair_b" -- $(size_args) --bf16 --use-distributed-optimizer --num-experts 4 --moe-ffn-hidden-size 2048 --expert-model-parallel-size 2'
  lane gpu_tests "$g1" "$pair_b"
  lane mlm main
  ;;
2)
  lane mlm dev
  ;;
*) echo "batch: 1 | 2" >&2; exit 2 ;;
esac
wait
tar -czf "$out/batch-$batch.tgz" -C "$res" .
cat "$res/machine.txt" "$res"/exits.txt 2>/dev/null
