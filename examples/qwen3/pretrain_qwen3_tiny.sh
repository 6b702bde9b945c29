#!/usr/bin/env bash
# qwen3-tiny through the same recipe machinery as the 1.7B-32B scripts (common.sh), small
# enough for CPU: 2 layers, hidden 64, SwiGLU ffn 176, 4 query heads in 2 KV groups of head
# dim 16, QK RMSNorm, RoPE base 1e6, untied output layer, vocabulary 1024 (the demo
# tokenizer's), sequence 64. Two gloo ranks (DP 2), fp32 (bf16 for VARIANT=layerwise), Muon
# with --canzona and torch_dist checkpoints by default, as the GPU recipes (qwen3_cpu_main in
# common.sh). tools/slurm_local.sh submits it through slurm_pretrain.sbatch.
#
#   examples/qwen3/pretrain_qwen3_tiny.sh                            # 100 iterations, ~25 s on 2 cores
#   TRAIN_ITERS=150 examples/qwen3/pretrain_qwen3_tiny.sh --override-opt_param-scheduler  # resume to 150
#   VARIANT=adamw CKPT_DIR=none examples/qwen3/pretrain_qwen3_tiny.sh     # AdamW, no checkpoints
#
# A resume loads the whole optimizer state (canzona_patches/checkpoints/state.py): tests/e2e/
# test_resume.py resumes a run exactly, and tools/slurm_local.sh does under SLURM.
# For a quick look at the loss curve, pretrain_qwen3_tiny_cpu.sh plots one.
set -euo pipefail

MODEL=qwen3-tiny

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
qwen3_cpu_main "$@"
