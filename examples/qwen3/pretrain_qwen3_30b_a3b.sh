#!/usr/bin/env bash
# Qwen3-30B-A3B pretraining recipe: 48 layers, hidden 2048, every layer a mixture of 128 SwiGLU
# experts of ffn 768 with top-8 routing (softmax router, normalised top-8 probabilities,
# load-balancing loss 1e-3, no shared expert), 32 query heads in 4 KV groups of head dim 128,
# QK RMSNorm, RoPE base 1e6, vocabulary 151936, untied embeddings.
# TP 1, EP 8 inside an 8-GPU node (16 experts per GPU), DP over every GPU, expert-DP over the
# nodes; sequence 4096, global batch 128 (0.5M tokens), micro batch 1, lr 4e-4 cosine to 4e-5
# after 50 warm-up steps, grad clip 1.0, bf16.
#
#   sbatch --nodes 8 --gpus-per-node 8 examples/qwen3/slurm_pretrain.sbatch examples/qwen3/pretrain_qwen3_30b_a3b.sh
#   DRY_RUN=1 examples/qwen3/pretrain_qwen3_30b_a3b.sh            # print the command only
#
# One node alone (expert-DP 1) keeps the whole optimizer state of its 16 experts per GPU,
# about 3.6B parameters: 43 GB for AdamW's fp32 copy and moments; 8 nodes shard it 8 ways.
# VARIANT=canzona|sync|layerwise|adamw and the other settings: see common.sh beside this file.
set -euo pipefail

MODEL=qwen3-30b-a3b
TP="${TP:-1}"
EP="${EP:-8}"
MICRO_BATCH="${MICRO_BATCH:-1}"

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
qwen3_recipe_main "$@"
