#!/usr/bin/env bash
# qwen3-tiny through the same recipe machinery as the 1.7B-32B scripts (common.sh), small
# enough for CPU: 2 layers, hidden 64, SwiGLU ffn 176, 4 query heads in 2 KV groups of head
# dim 16, QK RMSNorm, RoPE base 1e6, untied output layer, vocabulary 1024 (the demo
# tokenizer's), sequence 64. Two gloo ranks (DP 2), fp32 (bf16 for VARIANT=layerwise), Muon
# with --canzona and torch_dist checkpoints by default, as the GPU recipes.
# tools/slurm_local.sh submits it through slurm_pretrain.sbatch.
#
#   examples/qwen3/pretrain_qwen3_tiny.sh                            # 100 iterations, ~25 s on 2 cores
#   TRAIN_ITERS=150 examples/qwen3/pretrain_qwen3_tiny.sh --override-opt_param-scheduler  # resume to 150
#   VARIANT=adamw CKPT_DIR=none examples/qwen3/pretrain_qwen3_tiny.sh     # AdamW, no checkpoints
#
# A resume loads the whole optimizer state (canzona_patches/checkpoint.py): tests/e2e/
# test_resume.py resumes a run exactly, and tools/slurm_local.sh does under SLURM.
# For a quick look at the loss curve, pretrain_qwen3_tiny_cpu.sh plots one.
set -euo pipefail

MODEL=qwen3-tiny
NUM_LAYERS=2 HIDDEN_SIZE=64 FFN_HIDDEN_SIZE=176 NUM_HEADS=4
NUM_QUERY_GROUPS=2 KV_CHANNELS=16 VOCAB_SIZE=1024 TIED_EMBEDDINGS=0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VARIANT="${VARIANT:-canzona}"
if [[ -z "${PRECISION:-}" ]]; then
    # Megatron-Core 0.19.2's layer-wise Muon only chains its sub-optimizers in bf16 (in fp32
    # they carry no config and ChainedOptimizer asserts).
    if [[ "$VARIANT" == layerwise ]]; then PRECISION=bf16; else PRECISION=fp32; fi
fi
NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
SEQ_LENGTH="${SEQ_LENGTH:-64}"
GLOBAL_BATCH="${GLOBAL_BATCH:-8}"
MICRO_BATCH="${MICRO_BATCH:-2}"
TRAIN_ITERS="${TRAIN_ITERS:-100}"
LR="${LR:-3e-3}"
MIN_LR="${MIN_LR:-3e-4}"
WARMUP_ITERS="${WARMUP_ITERS:-10}"
NUM_WORKERS="${NUM_WORKERS:-0}"
TOKENIZER_TYPE="${TOKENIZER_TYPE:-SentencePieceTokenizer}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:-$ROOT/data/demo/tokenizer.model}"
DATA_PATH="${DATA_PATH:-$ROOT/data/demo/demo_text_document}"
SPLIT="${SPLIT:-949,50,1}"
CKPT_FORMAT="${CKPT_FORMAT:-torch_dist}"
SAVE_INTERVAL="${SAVE_INTERVAL:-50}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
EVAL_INTERVAL="${EVAL_INTERVAL:-50}"
EVAL_ITERS="${EVAL_ITERS:-2}"
# One torch thread per rank: the ranks share the CPU cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ "${DRY_RUN:-0}" != 1 && "$DATA_PATH" == "$ROOT/data/demo/demo_text_document" \
      && ! -f "$DATA_PATH.idx" ]]; then
    qwen3_defaults
    "$PYTHON" "$ROOT/tools/prepare_demo_data.py" --output-dir "$ROOT/data/demo" > /dev/null
fi
qwen3_recipe_main "$@"
