#!/usr/bin/env bash
# One H200 (device kind nvidia-h200): a Llama-style GPT of 1.02 B
# parameters (18 layers, hidden 2048, FFN 5632, 16 heads in 4 query groups, SwiGLU, RMSNorm,
# RoPE, untied embeddings, no biases, seq 1024, vocab 50304) given to the resume benchmark as a
# user's own pretrain_gpt.py arguments, one run per row, side by side through
# megatron-lm-suite.sh (same installs, results in $OUT/suite.tgz).
#   ROWS="llama-distributed llama-precision-aware llama-fp32" bash scripts/device/llama-table.sh
# A ROWS entry that is not a row is a built-in configuration (e.g. llama, with SIZE=1b).
# Rows: llama-distributed (BF16, distributed optimizer), llama-precision-aware (+ BF16 moments),
# llama-fp32 (FP32, no distributed optimizer), llama-fp32-gelu (the same without SwiGLU),
# llama-fp32-no-gqa (the same without GQA). Without --deterministic (DETERMINISTIC=0: a 1 B
# run's three checkpoints would not fit the disk side by side); ITERS (default "6 3"), GPU_TESTS
# (default 0) and RUN_SECONDS pass through.
set -euo pipefail
llama=(--num-layers 18 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
  --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 16
  --vocab-size 50304 --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --disable-bias-linear --lr 3e-4 --min-lr 3e-5
  --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
  --tokenizer-type NullTokenizer --transformer-impl transformer_engine --seed 1234)
gqa="--group-query-attention --num-query-groups 4"
distributed="--bf16 --use-distributed-optimizer"
declare -A rows=(
  [llama-distributed]="${llama[*]} --swiglu $gqa $distributed"
  [llama-precision-aware]="${llama[*]} --swiglu $gqa $distributed --use-precision-aware-optimizer
    --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
  [llama-fp32]="${llama[*]} --swiglu $gqa"
  [llama-fp32-gelu]="${llama[*]} $gqa"
  [llama-fp32-no-gqa]="${llama[*]} --swiglu"
)
runs=()
for row in ${ROWS:-llama-distributed llama-precision-aware llama-fp32}; do
  if [[ -n ${rows[$row]:-} ]]; then
    runs+=("$row:$(echo ${rows[$row]})")
  else
    runs+=("$row")  # a built-in configuration, at $SIZE
  fi
done
DETERMINISTIC=${DETERMINISTIC:-0} ITERS=${ITERS:-6 3} GPU_TESTS=${GPU_TESTS:-0} exec bash "$(dirname "$0")/megatron-lm-suite.sh" "${runs[@]}"
