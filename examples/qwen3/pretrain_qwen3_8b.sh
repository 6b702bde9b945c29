#!/usr/bin/env bash
# Qwen3-8B pretraining recipe: 36 layers, hidden 4096, SwiGLU ffn 12288, 32 query heads in 8 KV groups
# of head dim 128, QK RMSNorm, RoPE base 1e6, vocabulary 151936, untied embeddings.
# TP 2 inside an 8-GPU node, DP over the rest; sequence 4096, global batch 128 (0.5M tokens),
# micro batch 1, lr 4e-4 cosine to 4e-5 after 50 warm-up steps, grad clip 1.0, bf16.
#
#   sbatch --nodes 8 --gpus-per-node 8 examples/qwen3/slurm_pretrain.sbatch examples/qwen3/pretrain_qwen3_8b.sh
#   VARIANT=adamw examples/qwen3/pretrain_qwen3_8b.sh        # one node, without SLURM
#   DRY_RUN=1 examples/qwen3/pretrain_qwen3_8b.sh            # print the command only
#
# VARIANT=canzona|sync|layerwise|adamw and the other settings: see common.sh beside this file.
set -euo pipefail
MODEL=qwen3-8b TP="${TP:-2}" MICRO_BATCH="${MICRO_BATCH:-1}"
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" && qwen3_recipe_main "$@"
