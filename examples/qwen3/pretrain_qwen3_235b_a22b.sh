#!/usr/bin/env bash
# Qwen3-235B-A22B pretraining recipe: 94 layers, hidden 4096, every layer a mixture of 128
# SwiGLU experts of ffn 1536 with top-8 routing (softmax router, normalised top-8
# probabilities, load-balancing loss 1e-3, no shared expert), 64 query heads in 4 KV groups of
# head dim 128, QK RMSNorm, RoPE base 1e6, vocabulary 151936, untied embeddings.
# TP 4 inside an 8-GPU node, PP 8 of 11 + 6 x 12 + 11 layers (the first and last stages also
# hold the embedding and the output layer), EP 8 with expert TP 1 (16 experts per GPU), DP over
# the rest; sequence 4096, global batch 128 (0.5M tokens), micro batch 1, lr 4e-4 cosine to
# 4e-5 after 50 warm-up steps, grad clip 1.0, bf16.
#
#   sbatch --nodes 32 --gpus-per-node 8 examples/qwen3/slurm_pretrain.sbatch examples/qwen3/pretrain_qwen3_235b_a22b.sh
#   DRY_RUN=1 examples/qwen3/pretrain_qwen3_235b_a22b.sh          # print the command only
#
# The job takes a multiple of 8 nodes (EP 8 x PP 8 for the experts, TP 4 x PP 8 for the rest).
# Each GPU holds about 3.6B expert parameters; at 8 nodes (expert-DP 1) AdamW's fp32 copy and
# moments of them alone would take 43 GB of it, so 16 nodes (expert-DP 2) and more.
# VARIANT=canzona|sync|layerwise|adamw and the other settings: see common.sh beside this file.
set -euo pipefail

MODEL=qwen3-235b-a22b
TP="${TP:-4}"
PP="${PP:-8}"
# 94 layers do not split into 8 equal stages: 11 + 6 x 12 + 11.
PP_FIRST_LAYERS="${PP_FIRST_LAYERS:-11}"
PP_LAST_LAYERS="${PP_LAST_LAYERS:-11}"
EP="${EP:-8}"
MICRO_BATCH="${MICRO_BATCH:-1}"

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
qwen3_recipe_main "$@"
