#!/usr/bin/env bash
# One H200 (device kind nvidia-h200): the Megatron-LM client of the resume benchmark,
# Megatron-LM core_r0.19.0's pretrain_gpt.py on a ~1.07 B-parameter GPT, upstream megatron-core
# 0.19.2 against the build (configuration dp-reshardable, size 1b); everything lands in
# $OUT/mlm-<MODE>.{json,md,log} and $OUT/dp-reshardable.png.
#   bash scripts/device/megatron-lm-client.sh smoke          # size tiny, minutes
#   bash scripts/device/megatron-lm-client.sh default        # 1,076,899,840 parameters
#   bash scripts/device/megatron-lm-client.sh deterministic  # the same with --deterministic-mode
# Needs .gpu/wheels (TE and its dependencies, upstream 0.19.2), .gpu/dist-0.19.2 (the build) and
# .gpu/mlm-client/megatron-lm-core_r0.19.0.tar.gz (git archive of pretrain_gpt.py gpt_builders.py
# model_provider.py megatron).
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=$1
out=${OUT:-/tmp/out} && mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [[ ! -f /tmp/te/.done ]]; then
  SKIP=megatron_core bash .gpu/wheels/install.sh /tmp/te > /dev/null && touch /tmp/te/.done
fi
for side in upstream build; do
  wheel=$([[ $side == upstream ]] && ls .gpu/wheels/megatron_core-0.19.2-*.whl || ls .gpu/dist-0.19.2/*.whl)
  [[ -f /tmp/mc-$side/.done ]] || { python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/mc-$side "$wheel" && touch /tmp/mc-$side/.done; }
done
mkdir -p /tmp/megatron-lm && tar -xzf .gpu/mlm-client/megatron-lm-core_r0.19.0.tar.gz -C /tmp/megatron-lm
export PYTHONPATH=/tmp/te
size=1b flags=()
case $mode in
  smoke) size=tiny ;;
  default) ;;
  deterministic) flags=(--deterministic) ;;
  *) echo "mode: smoke | default | deterministic" >&2; exit 2 ;;
esac
{ nvidia-smi -L; df -h /tmp /dev/shm; git log --oneline -1; } > "$out/mlm-$mode.machine.txt" 2>&1
python3 -m benchmarks.resume_benchmark --megatron-lm /tmp/megatron-lm \
  --upstream /tmp/mc-upstream --build /tmp/mc-build --work-dir "/tmp/mlm-$mode" \
  --configs dp-reshardable --size "$size" --train-iters 10 --resume-at 5 "${flags[@]}" \
  --json-out "$out/mlm-$mode.json" --markdown-out "$out/mlm-$mode.md" --figures-dir "$out" \
  > "$out/mlm-$mode.log" 2>&1
echo "mlm-$mode exit $?" | tee -a "$out/mlm-$mode.machine.txt"
tar -czf "$out/mlm-$mode.logs.tgz" -C "/tmp/mlm-$mode/dp-reshardable" $(cd "/tmp/mlm-$mode/dp-reshardable" && ls *.log 2>/dev/null)
tail -40 "$out/mlm-$mode.log"
