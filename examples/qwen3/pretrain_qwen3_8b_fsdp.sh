#!/usr/bin/env bash
# Qwen3-8B pretraining under Megatron-FSDP (docs/fsdp.md): weights, gradients and optimizer state
# sharded over every GPU (optim_grads_params: each transformer layer all-gathered for its forward
# and backward, its gradients reduce-scattered), TP 1, fsdp_dtensor checkpoints that resume at any
# FSDP size. Canzona hosts gate and up of every fc1 apart (--canzona-split-gate-up), what
# `tools/simulate.py --fsdp-cases` projects fastest at 64-256 GPUs; the holders send each other whole
# matrix's Muon input to its host in bf16, divided by its exact norm (--canzona-narrow-gathers, the
# default under Megatron-FSDP: half those gathers' bytes, bitwise the same run). The model, data and schedule
# are pretrain_qwen3_8b.sh's: sequence 4096, global batch 128, micro batch 1, bf16 (above 128 GPUs
# raise GLOBAL_BATCH to a multiple of the GPU count, e.g. GLOBAL_BATCH=256 on 256).
#
#   sbatch --nodes 8 --gpus-per-node 8 examples/qwen3/slurm_pretrain.sbatch examples/qwen3/pretrain_qwen3_8b_fsdp.sh
#   VARIANT=adamw examples/qwen3/pretrain_qwen3_8b_fsdp.sh   # Megatron's AdamW under Megatron-FSDP
#   DRY_RUN=1 examples/qwen3/pretrain_qwen3_8b_fsdp.sh       # print the command only
#
# VARIANT=canzona|sync|adamw (Megatron's layer-wise Muon does not run under FSDP), FSDP=<strategy>
# and the other settings: see common.sh beside this file.
set -euo pipefail
MODEL=qwen3-8b TP="${TP:-1}" MICRO_BATCH="${MICRO_BATCH:-1}" FSDP="${FSDP:-optim_grads_params}"
LOG_DIR="${LOG_DIR:-$(dirname "${BASH_SOURCE[0]}")/../../build/qwen3-8b-fsdp-${VARIANT:-canzona}}"
split=()
if [[ "${VARIANT:-canzona}" == canzona || "${VARIANT:-canzona}" == sync ]]; then
    split=(--canzona-split-gate-up)
fi
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" && qwen3_recipe_main "${split[@]}" "$@"
