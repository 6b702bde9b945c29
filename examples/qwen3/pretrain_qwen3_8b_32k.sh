#!/usr/bin/env bash
# Qwen3-8B at 32K tokens, the context-extension phase: the 8B architecture (36 layers, hidden
# 4096, SwiGLU ffn 12288, 32 query heads in 8 KV groups of head dim 128), each 32768-token
# sequence cut over CP 4 GPUs (context parallelism) and TP 2 inside an 8-GPU node, DP over the
# rest; global batch 32 (1M tokens), micro batch 1, lr 4e-4 cosine to 4e-5, grad clip 1.0, bf16.
# The optimizer and the gradient buckets span DP x CP, as Megatron's DDP reduces over them.
#
#   sbatch --nodes 8 --gpus-per-node 8 examples/qwen3/slurm_pretrain.sbatch examples/qwen3/pretrain_qwen3_8b_32k.sh
#   DRY_RUN=1 examples/qwen3/pretrain_qwen3_8b_32k.sh        # print the command only
#   python tools/simulate.py --model qwen3-8b --gpus 64 --tp 2 --cp 4 --seq-length 32768 --global-batch 32
#
# VARIANT=canzona|sync|layerwise|adamw and the other settings: see common.sh beside this file.
set -euo pipefail
MODEL=qwen3-8b TP="${TP:-2}" CP="${CP:-4}" SEQ_LENGTH="${SEQ_LENGTH:-32768}" GLOBAL_BATCH="${GLOBAL_BATCH:-32}"
MICRO_BATCH="${MICRO_BATCH:-1}" LOG_DIR="${LOG_DIR:-$(dirname "${BASH_SOURCE[0]}")/../../build/qwen3-8b-32k-${VARIANT:-canzona}}"
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" && qwen3_recipe_main "$@"
