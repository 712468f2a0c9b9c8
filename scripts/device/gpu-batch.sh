#!/usr/bin/env bash
# The GPU runs of the report, on one offline H200 machine with 4 GPUs (device kind
# nvidia-h200-x4) or 2 (nvidia-h200-x2; the 4-GPU layouts are then left out), as concurrent
# lanes; everything lands in $OUT/batch-<N>.tgz. Memory peaks are per process
# (torch.cuda.max_memory_allocated), so lanes sharing a GPU do not disturb them; load times of
# lanes running side by side are not comparable and are not reported as results.
#   bash scripts/device/gpu-batch.sh 1   # multi-rank: 2 GPUs (DP=2, TP=2, MoE EP=2, 2->1, 1->2),
#                                        # 4 GPUs (DP=4, TP2xDP2, EP2xDP2, 4->2, 2->4), GPU tests,
#                                        # Megatron-LM unit tests of main
#   bash scripts/device/gpu-batch.sh 2   # one GPU, default size: FP32 and precision-aware
#                                        # cases (with and without the plugin), Bridge-like
#                                        # instance loader, releases 0.16.1 and 0.18.2;
#                                        # Megatron-LM unit tests of dev
#   bash scripts/device/gpu-batch.sh 3   # one GPU (nvidia-h200), session 10: default-size FP32
#                                        # dp_reshardable and precision-aware with the plugin,
#                                        # Bridge-like instance loader (small), the GPU tests
#   bash scripts/device/gpu-batch.sh 4   # one GPU: the call sites of issue #19 (Megatron-FSDP,
#                                        # non-distributed BF16 and FP32, CPU offload), upstream
#                                        # against the build (PRESET=small; GPU_TESTS=1 adds them)
#   bash scripts/device/gpu-batch.sh 5   # one GPU: issue #20, precision-aware with the plugin's
#                                        # read targets: BF16 dp_reshardable and MoE at the
#                                        # default size, FP16 moments (default size), BF16
#                                        # fully_reshardable/dp_zero with FP32 master weights
#                                        # (PRESET=small), the GPU tests; LANES="..." picks
#                                        # lanes (also fp32-default: FP32 without the plugin)
# Needs .gpu/ from scripts/device/make-bundle.sh. LANE_SECONDS bounds every lane (default 530).
set -uo pipefail
cd "$(dirname "$0")/../.."
batch=$1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
limit=${LANE_SECONDS:-530}
res=/tmp/res-$batch && rm -rf "$res" && mkdir -p "$res"
out=${OUT:-/tmp/out} && mkdir -p "$out"

# One shared site with TE and its dependencies; one small site per megatron-core side.
if [[ ! -f /tmp/te/.done ]]; then
  SKIP=megatron_core bash .gpu/wheels/install.sh /tmp/te > /dev/null && touch /tmp/te/.done
fi
site() {  # site DIR WHEEL...
  [[ -f "$1/.done" ]] || { python3 -m pip install -q --no-index --no-deps --no-compile --target "$1" "${@:2}" && touch "$1/.done"; }
}
site /tmp/mc-upstream .gpu/wheels/megatron_core-0.19.2-*.whl
site /tmp/mc-build .gpu/dist-0.19.2/*.whl
site /tmp/mc-plugin .gpu/dist-0.19.2/*.whl .gpu/plugin/*.whl
for v in 0.16.1 0.18.2; do
  site /tmp/mc-upstream-$v .gpu/upstream/megatron_core-$v-*.whl
  site /tmp/mc-build-$v .gpu/dist-$v/*.whl
done
export PYTHONPATH=/tmp/te
ngpu=$(nvidia-smi -L | wc -l)
if ((ngpu >= 4)); then pair_a=0,1 pair_b=2,3 g0=0 g1=1 g2=2 g3=3
else pair_a=0,1 pair_b=0,1 g0=0 g1=1 g2=0 g3=1; fi
{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__)'; git log --oneline -1; } > "$res/machine.txt" 2>&1

bench() {  # bench NAME UPSTREAM BUILD ARGS...: one benchmark invocation with --check
  local name=$1 up=$2 build=$3; shift 3
  timeout "$limit" python3 -m benchmarks.resume_benchmark --upstream "$up" --build "$build" --check \
    --work-dir "/tmp/work-$batch-$name" --json-out "$res/$name.json" --markdown-out "$res/$name.md" "$@" \
    > "$res/$name.log" 2>&1
  echo "$name exit $?" >> "$res/exits.txt"
}
lane() { ( "$@" ) & }
small() { bench "$1" /tmp/mc-upstream /tmp/mc-build --preset small "${@:2}"; }
three=dp_reshardable,fully_reshardable,dp_zero_gather_scatter
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

case $batch in
0)  # smoke: every code path once, tiny model
  tiny() { bench "$1" /tmp/mc-upstream /tmp/mc-build --preset tiny "${@:2}"; }
  lane tiny smoke-dp2 --gpus 0,1 --nproc-per-node 2 --cases dp_reshardable
  lane tiny smoke-dp2-to-dp1 --gpus 0,1 --nproc-per-node 2 --resume-nproc-per-node 1 --cases fully_reshardable
  lane tiny smoke-ep2 --gpus 2,3 --nproc-per-node 2 --expert-model-parallel-size 2 --cases moe
  lane eval 'tiny smoke-bridge --gpus 3 --instance-loader bridge-like --cases dp_reshardable'
  lane eval 'bench smoke-pa /tmp/mc-upstream /tmp/mc-plugin --preset tiny --gpus 2 --cases moe_precision_aware_bf16'
  lane eval 'bench smoke-0.16.1 /tmp/mc-upstream-0.16.1 /tmp/mc-build-0.16.1 --preset tiny --gpus 1 --cases dp_reshardable'
  lane eval 'PYTHONPATH=/tmp/mc-build:/tmp/te CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest tests/gpu/test_memory_timeline_gpu.py -q -rA -p no:cacheprovider > $res/smoke-timeline.log 2>&1; PYTHONPATH=/tmp/mc-build:/tmp/te CUDA_VISIBLE_DEVICES=2,3 timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m pytest tests/gpu/test_multirank_gpu.py -q -rA -p no:cacheprovider > $res/smoke-multirank.log 2>&1'
  ;;
1)
  lane small dp2 --gpus $pair_a --nproc-per-node 2 --cases "$three"
  lane small dp2-to-dp1 --gpus $pair_a --nproc-per-node 2 --resume-nproc-per-node 1 --cases "$three"
  lane small dp1-to-dp2 --gpus $pair_b --nproc-per-node 1 --resume-nproc-per-node 2 --cases "$three"
  lane eval 'small tp2 --gpus $pair_b --nproc-per-node 2 --tensor-model-parallel-size 2 --cases dp_reshardable; small ep2 --gpus $pair_b --nproc-per-node 2 --expert-model-parallel-size 2 --cases moe'
  if ((ngpu >= 4)); then
    lane eval 'small dp4 --gpus 0,1,2,3 --nproc-per-node 4 --cases dp_reshardable; small tp2-dp2 --gpus 0,1,2,3 --nproc-per-node 4 --tensor-model-parallel-size 2 --cases dp_reshardable; small ep2-dp2 --gpus 0,1,2,3 --nproc-per-node 4 --expert-model-parallel-size 2 --cases moe'
    lane small dp4-to-dp2 --gpus 0,1,2,3 --nproc-per-node 4 --resume-nproc-per-node 2 --cases "$three"
    lane small dp2-to-dp4 --gpus 0,1,2,3 --nproc-per-node 2 --resume-nproc-per-node 4 --cases "$three"
  fi
  lane gpu_tests $g1 $pair_b
  lane mlm main
  ;;
2)
  lane eval 'bench fp32-pa-plugin /tmp/mc-upstream /tmp/mc-plugin --gpus $g0 --cases dp_reshardable,precision_aware_bf16'
  lane eval 'bench moe-plugin /tmp/mc-upstream /tmp/mc-plugin --gpus $g1 --cases moe,moe_precision_aware_bf16'
  lane eval 'bench pa-no-plugin /tmp/mc-upstream /tmp/mc-build --gpus $g2 --cases precision_aware_bf16; bench bridge-like /tmp/mc-upstream /tmp/mc-build --gpus $g2 --instance-loader bridge-like --cases dp_reshardable'
  lane eval 'bench release-0.16.1 /tmp/mc-upstream-0.16.1 /tmp/mc-build-0.16.1 --gpus $g3 --cases dp_reshardable; bench release-0.18.2 /tmp/mc-upstream-0.18.2 /tmp/mc-build-0.18.2 --gpus $g3 --cases dp_reshardable'
  lane mlm dev
  ;;
3)  # one GPU shared by the lanes (memory peaks are per process)
  lane eval 'bench fp32-default /tmp/mc-upstream /tmp/mc-build --gpus 0 --cases dp_reshardable'
  lane eval 'bench pa-plugin-default /tmp/mc-upstream /tmp/mc-plugin --gpus 0 --cases precision_aware_bf16'
  lane eval 'small bridge-like-small --gpus 0 --instance-loader bridge-like --cases dp_reshardable'
  lane eval 'PYTHONPATH=/tmp/mc-plugin:/tmp/te CUDA_VISIBLE_DEVICES=0 timeout "$limit" python3 -m pytest tests/gpu -q -rA -p no:cacheprovider --ignore=tests/gpu/test_multirank_gpu.py > "$res/gpu-tests.log" 2>&1; PYTHONPATH=/tmp/mc-build:/tmp/te CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest tests/gpu/test_mcore_resume_gpu.py -q -rA -p no:cacheprovider > "$res/gpu-tests-build-only.log" 2>&1'
  ;;
4)  # one GPU: issue #19's call sites, upstream against the build, a lane per path
  sites() {  # sites PATH: python -m benchmarks.resume_benchmark.call_sites for one path
    timeout "$limit" python3 -m benchmarks.resume_benchmark.call_sites --upstream /tmp/mc-upstream \
      --build /tmp/mc-build --paths "$1" --preset "${PRESET:-small}" --work-dir "/tmp/work-4-$1" \
      --json-out "$res/call-sites-$1.json" --markdown-out "$res/call-sites-$1.md" > "$res/call-sites-$1.log" 2>&1
    echo "call-sites-$1 exit $?" >> "$res/exits.txt"; cp -r "/tmp/work-4-$1" "$res/raw-$1" 2>/dev/null
  }
  for p in ${PATHS:-megatron_fsdp float16_wrapper fp32_wrapper cpu_offload}; do lane sites $p; done
  [[ -n "${GPU_TESTS:-}" ]] && lane eval 'PYTHONPATH=/tmp/mc-plugin:/tmp/te CUDA_VISIBLE_DEVICES=0 timeout "$limit" python3 -m pytest tests/gpu -q -rA -p no:cacheprovider --ignore=tests/gpu/test_multirank_gpu.py > "$res/gpu-tests.log" 2>&1'
  ;;
5)  # one GPU shared by the lanes (memory peaks are per process)
  pa() { bench "$1" /tmp/mc-upstream /tmp/mc-plugin --gpus 0 "${@:2}"; }
  for l in ${LANES:-pa-bf16-default moe-pa-default pa-formats pa-fp16}; do
    case $l in
      pa-bf16-default) lane pa pa-bf16-default --cases precision_aware_bf16 ;;
      moe-pa-default) lane pa moe-pa-default --cases moe_precision_aware_bf16 ;;
      pa-formats) lane pa pa-formats --preset "${PRESET:-small}" --cases precision_aware_bf16_fully_reshardable,precision_aware_bf16_dp_zero_gather_scatter ;;
      pa-fp16) lane pa pa-fp16 --cases precision_aware_fp16 ;;
      fp32-default) lane bench fp32-default /tmp/mc-upstream /tmp/mc-build --gpus 0 --cases dp_reshardable ;;  # no plugin
      *) echo "unknown lane $l" >&2 ;;
    esac
  done
  [[ -n "${GPU_TESTS:-}" ]] && lane eval 'PYTHONPATH=/tmp/mc-plugin:/tmp/te CUDA_VISIBLE_DEVICES=0 timeout "$limit" python3 -m pytest tests/gpu -q -rA -p no:cacheprovider --ignore=tests/gpu/test_multirank_gpu.py > "$res/gpu-tests.log" 2>&1'
  ;;
*) echo "unknown batch $batch" >&2; exit 2 ;;
esac
wait
tar czf "$out/batch-$batch.tgz" -C "$res" .
cat "$res/exits.txt"; grep -hE "^[0-9]+ (passed|failed)" "$res"/gpu-tests*.log 2>/dev/null | tail -3
cat "$res"/mlm/*/summary.txt 2>/dev/null || true  # batches without Megatron-LM lanes have none
