#!/usr/bin/env bash
# qwen3-moe-tiny: Qwen3-MoE's structure (every layer a mixture of experts, softmax top-k
# router with normalised top-k probabilities and a load-balancing loss) small enough for CPU:
# 2 layers, hidden 64, 4 experts of SwiGLU ffn 32 with top-2 routing, 4 query heads in 2 KV
# groups of head dim 16, QK RMSNorm, RoPE base 1e6, untied output layer, vocabulary 1024 (the
# demo tokenizer's), sequence 64. Two gloo ranks: DP 2 for the dense weights, EP 2 for the
# experts (2 on each rank, expert-DP 1). The rest as pretrain_qwen3_tiny.sh (qwen3_cpu_main in
# common.sh): fp32 (bf16 for VARIANT=layerwise), Muon with --canzona and torch_dist
# checkpoints by default.
#
#   examples/qwen3/pretrain_qwen3_moe_tiny.sh                        # 100 iterations
#   VARIANT=adamw CKPT_DIR=none examples/qwen3/pretrain_qwen3_moe_tiny.sh   # AdamW, no checkpoints
#   DRY_RUN=1 examples/qwen3/pretrain_qwen3_moe_tiny.sh              # print the command only
set -euo pipefail

MODEL=qwen3-moe-tiny
# The local transformer layers of the CPU path have no grouped GEMM: experts run one by one.
MOE_GROUPED_GEMM=0
EP="${EP:-2}"

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
qwen3_cpu_main "$@"
