#!/usr/bin/env bash
# One H200 (device kind nvidia-h200): the resume benchmark's built-in configurations
# (benchmarks/resume_benchmark/configs.py) at --size small in Megatron-LM core_r0.19.0's
# pretrain_gpt.py, upstream megatron-core 0.19.2 against the build with the example plugin
# installed (so precision-aware shows the opt-in adopter; the FP32 modes show the default one),
# each configuration its own invocation, all side by side (every process has the GPU's
# allocator to itself, so its peaks are its own), --deterministic; meanwhile the GPU tests
# (tests/gpu, one GPU; GPU_TESTS=0 leaves them out). Results are packed every 20 s, so a run cut
# short keeps what ended.
#   bash scripts/device/megatron-lm-suite.sh [CONFIG ...]      # default: every configuration
#   A CONFIG of the form NAME:ARGS runs the user's pretrain_gpt.py ARGS (after --) as NAME.
#   SIZE (default small) sizes the built-in configurations; ITERS="10 5" sets --train-iters and
#   --resume-at; DETERMINISTIC=0 runs without --deterministic (the resumes save no checkpoint:
#   the disk holds one checkpoint per run instead of three).
# Results: $OUT/suite.tgz (suite-<CONFIG>.{json,md}, figures/, logs/, gpu-tests.log).
# Needs .gpu/wheels (TE, upstream 0.19.2), .gpu/dist-0.19.2 (the build), .gpu/plugin (the
# example plugin's wheel) and .gpu/mlm-client/megatron-lm-core_r0.19.0.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/out} && mkdir -p "$out"
results=/tmp/suite-results && mkdir -p "$results/logs"
export PYTHONUNBUFFERED=1
[[ -f /tmp/te/.done ]] || { SKIP=megatron_core bash .gpu/wheels/install.sh /tmp/te > /dev/null && touch /tmp/te/.done; }
install() {  # install TARGET WHEEL...
  [[ -f $1/.done ]] || { python3 -m pip install -q --no-index --no-deps --no-compile --target "$1" "${@:2}" && touch "$1/.done"; }
}
install /tmp/mc-upstream .gpu/wheels/megatron_core-0.19.2-*.whl
install /tmp/mc-build .gpu/dist-0.19.2/*.whl .gpu/plugin/*.whl
mkdir -p /tmp/megatron-lm && tar -xzf .gpu/mlm-client/megatron-lm-core_r0.19.0.tar.gz -C /tmp/megatron-lm
export PYTHONPATH=/tmp/te
configs=("$@")
[[ ${#configs[@]} -gt 0 ]] || mapfile -t configs < <(python3 -c 'from benchmarks.resume_benchmark.configs import CONFIGURATIONS as c
print(*c, sep="\n")')
{ nvidia-smi -L; df -h /tmp /dev/shm; git log --oneline -1; git status --short | head -20; } > "$results/machine.txt" 2>&1
pack() { tar -czf "$out/suite.tgz.part" -C "$results" . 2>/dev/null && mv "$out/suite.tgz.part" "$out/suite.tgz"; }
( while sleep 20; do pack; done ) &
packer=$!
[[ ${GPU_TESTS:-1} == 0 ]] || PYTHONPATH=/tmp/mc-build:/tmp/te timeout "${GPU_TESTS_SECONDS:-420}" python3 -m pytest tests/gpu \
  -q -rA -p no:cacheprovider --ignore=tests/gpu/test_multirank_gpu.py > "$results/gpu-tests.log" 2>&1 &
for i in "${!configs[@]}"; do
  config=${configs[$i]} root=/tmp
  (( i % 2 )) && root=/dev/shm
  mode=(--deterministic)
  [[ ${DETERMINISTIC:-1} == 1 ]] || mode=()
  run=(--configs "$config" --size "${SIZE:-small}")
  if [[ $config == *:* ]]; then
    read -ra user <<< "${config#*:}"
    config=${config%%:*} run=(--name "$config" -- "${user[@]}")
  fi
  read -r iters resume_at <<< "${ITERS:-10 5}"
  (
    timeout "${RUN_SECONDS:-530}" python3 -m benchmarks.resume_benchmark \
      --megatron-lm /tmp/megatron-lm --upstream /tmp/mc-upstream --build /tmp/mc-build \
      --train-iters "$iters" --resume-at "$resume_at" "${mode[@]}" \
      --work-dir "$root/suite-$config" --json-out "$results/suite-$config.json" \
      --markdown-out "$results/suite-$config.md" --figures-dir "$results/figures" \
      "${run[@]}" > "$results/logs/$config.console.log" 2>&1
    echo "suite $config ${mode[*]} exit $?" >> "$results/machine.txt"
    mkdir -p "$results/logs/$config"
    find "$root/suite-$config" -maxdepth 2 -name '*.log' -exec cp {} "$results/logs/$config/" \;
  ) &
done
wait $(jobs -rp | grep -v "^$packer$")
kill "$packer" 2>/dev/null
pack
cat "$results/machine.txt"; tail -3 "$results/gpu-tests.log"
for f in "$results"/suite-*.md; do sed -n '/^| configuration/,/^$/p' "$f"; done
