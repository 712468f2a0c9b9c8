#!/usr/bin/env bash
# One H200 (device kind nvidia-h200): the Megatron-LM client of the resume benchmark (issue #21),
# Megatron-LM core_r0.19.0's pretrain_gpt.py on a ~1.07 B-parameter GPT, upstream megatron-core
# 0.19.2 against the build; everything lands in $OUT/mlm-<MODE>.{json,md,log}.
#   bash scripts/device/megatron-lm-client.sh smoke          # a 2-layer GPT, minutes
#   bash scripts/device/megatron-lm-client.sh default        # ~1.07 B parameters
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
gpt=(--num-layers 20 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
     --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 16)
flags=()
case $mode in
  smoke) gpt=(--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256
              --max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 4) ;;
  default) ;;
  deterministic) flags=(--deterministic) ;;
  *) echo "mode: smoke | default | deterministic" >&2; exit 2 ;;
esac
{ nvidia-smi -L; df -h /tmp /dev/shm; git log --oneline -1; } > "$out/mlm-$mode.machine.txt" 2>&1
python3 -m benchmarks.resume_benchmark megatron-lm --megatron-lm /tmp/megatron-lm \
  --upstream /tmp/mc-upstream --build /tmp/mc-build --work-dir "/tmp/mlm-$mode" \
  --train-iters 10 --resume-at 5 "${flags[@]}" \
  --json-out "$out/mlm-$mode.json" --markdown-out "$out/mlm-$mode.md" -- \
  "${gpt[@]}" --bf16 --use-distributed-optimizer --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine \
  --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --tokenizer-type NullTokenizer \
  --vocab-size 32000 --transformer-impl transformer_engine --seed 1234 \
  > "$out/mlm-$mode.log" 2>&1
echo "mlm-$mode exit $?" | tee -a "$out/mlm-$mode.machine.txt"
tar -czf "$out/mlm-$mode.logs.tgz" -C "/tmp/mlm-$mode" --exclude='*.json' $(cd "/tmp/mlm-$mode" && ls *.log 2>/dev/null)
tail -40 "$out/mlm-$mode.log"
