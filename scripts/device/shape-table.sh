#!/usr/bin/env bash
# One H200 (device kind nvidia-h200): public model shapes given to the resume benchmark as a
# user's own pretrain_gpt.py arguments, one run per row, side by side through
# megatron-lm-suite.sh (same installs, results in $OUT/suite.tgz).
#   ROWS="qwen0.5b-distributed qwen0.5b-fsdp" bash scripts/device/shape-table.sh
# A ROWS entry that is not a row is a built-in configuration (e.g. qwen, at SIZE).
# A row is SHAPE-MODE. Shapes (sequence 2048, SwiGLU, RMSNorm, RoPE, no linear biases but Qwen's
# on Q, K and V):
#   qwen0.5b  Qwen2.5-0.5B: 24 layers, hidden 896, FFN 4864, 14 heads, 2 query groups, QKV bias,
#             tied embeddings, vocab 151936 (qwen0.5b-vocab128000: the same with vocab 128000)
#   qwen1.5b  Qwen2.5-1.5B: 28 layers, hidden 1536, FFN 8960, 12 heads, 2 query groups, QKV bias,
#             tied, vocab 151936, micro-batch 1 (so that four rows fit on one H200 side by side)
#   qwen3b    Qwen2.5-3B: 36 layers, hidden 2048, FFN 11008, 16 heads, 2 query groups, QKV bias,
#             tied, vocab 151936, micro-batch 1
#   llama1b   Llama-3.2-1B: 16 layers, hidden 2048, FFN 8192, 32 heads, 8 query groups, tied,
#             vocab 128256
#   mixtral   Mixtral-style MoE at 1 B: 8 layers, hidden 1024, 16 heads, 4 query groups, 8
#             experts of FFN 3584, top-2, --moe-grouped-gemm, untied, vocab 32000
# Modes: distributed (BF16, distributed optimizer), overlap (the same with --overlap-grad-reduce
# --overlap-param-gather), fsdp (Megatron-FSDP, optim_grads_params, fsdp_dtensor), fp32 (FP32, no
# distributed optimizer), precision-aware (BF16 moments, TE master weights).
# DETERMINISTIC (default 1), ITERS (default "6 3"), GPU_TESTS (default 0) and RUN_SECONDS pass
# through.
set -euo pipefail
common=(--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2
  --global-batch-size 8 --swiglu --normalization RMSNorm --position-embedding-type rope
  --disable-bias-linear --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2
  --weight-decay 0.1 --clip-grad 1.0 --tokenizer-type NullTokenizer
  --transformer-impl transformer_engine --seed 1234)
qwen="--group-query-attention --num-query-groups 2 --add-qkv-bias"
declare -A shapes=(
  [qwen0.5b]="$qwen --num-layers 24 --hidden-size 896 --ffn-hidden-size 4864 --num-attention-heads 14 --vocab-size 151936"
  [qwen0.5b-vocab128000]="$qwen --num-layers 24 --hidden-size 896 --ffn-hidden-size 4864 --num-attention-heads 14 --vocab-size 128000"
  [qwen1.5b]="$qwen --num-layers 28 --hidden-size 1536 --ffn-hidden-size 8960 --num-attention-heads 12 --vocab-size 151936 --micro-batch-size 1"
  [qwen3b]="$qwen --num-layers 36 --hidden-size 2048 --ffn-hidden-size 11008 --num-attention-heads 16 --vocab-size 151936 --micro-batch-size 1"
  [llama1b]="--group-query-attention --num-query-groups 8 --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32 --vocab-size 128256"
  [mixtral]="--group-query-attention --num-query-groups 4 --num-layers 8 --hidden-size 1024 --ffn-hidden-size 3584 --num-attention-heads 16 --num-experts 8 --moe-router-topk 2 --moe-grouped-gemm --untie-embeddings-and-output-weights --vocab-size 32000"
)
distributed="--bf16 --use-distributed-optimizer"
declare -A modes=(
  [distributed]="$distributed"
  [overlap]="$distributed --overlap-grad-reduce --overlap-param-gather"
  [fsdp]="$distributed --use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy optim_grads_params"
  [fp32]=""
  [precision-aware]="$distributed --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
)
runs=()
for row in ${ROWS:-qwen0.5b-distributed qwen0.5b-fsdp qwen0.5b-fp32}; do
  shape=${row%-*} mode=${row##*-}
  [[ $row == *-precision-aware ]] && shape=${row%-precision-aware} mode=precision-aware
  if [[ -n ${shapes[$shape]:-} && -v modes[$mode] ]]; then
    runs+=("$row:${common[*]} ${shapes[$shape]} ${modes[$mode]}")  # a shape's own flags win
  else
    runs+=("$row")  # a built-in configuration, at $SIZE
  fi
done
DETERMINISTIC=${DETERMINISTIC:-1} ITERS=${ITERS:-6 3} GPU_TESTS=${GPU_TESTS:-0} exec bash "$(dirname "$0")/megatron-lm-suite.sh" "${runs[@]}"
