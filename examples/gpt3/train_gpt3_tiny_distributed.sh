#!/usr/bin/env bash
# Megatron-LM's GPT-3 175B example (examples/gpt3/train_gpt3_175b_distributed.sh) with its
# flags kept and only the sizes shrunk: a 4-layer GPT-3 of width 64 at TP 2 x PP 2 on 4 gloo
# processes of one CPU machine (or 4 GPUs), trained with Muon under --canzona.
#
#   examples/gpt3/train_gpt3_tiny_distributed.sh [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH]] [more flags]
#
# CHECKPOINT_PATH (default build/gpt3-tiny/checkpoints) is both --save and --load, as in the
# original: run the script again and it resumes from the last checkpoint. TensorBoard events
# go to TENSORBOARD_LOGS_PATH (default build/gpt3-tiny/tensorboard). Flags after the paths go
# last to pretrain_gpt.py, so they win (e.g. --exit-interval 10 to stop after iteration 10).
# About a minute on 2 CPU cores, most of it starting the 4 processes.
#
# What differs from the 175B script, and why:
#   * sizes: 4 layers (2 per pipeline stage), hidden 64, 4 heads, sequence 64; TP 8 x PP 16
#     becomes TP 2 x PP 2 (DP 1); the global batch 1536 becomes 8, its ramp-up "16 16 5859375"
#     becomes "2 2 48" (2, 4, 6, then 8 samples per step, 16 samples at each size); 500k
#     iterations with lr decay over 430k become 20 with decay over 18; log, eval and save
#     intervals of 100, 1000 and 10k iterations become 1, 5 and 5, and 10 eval iterations 2.
#   * data: --mock-data (Megatron's synthetic sequences) with the NullTokenizer over 512 ids
#     instead of --data-path with the GPT-2 BPE --vocab-file and --merge-file: no downloads
#     (--split stays, though mock data has its own splits).
#   * lr 6e-4 (min 6e-5), the GPT-3 paper's rate for its smallest model; 6e-5 is 175B's.
#   * --initial-loss-scale 2^20 (Megatron's default is 2^32): the loss is a mean over the
#     batch's tokens, so its gradients grow as the batch shrinks, and from 2^32 this run's
#     batches of 128 to 512 tokens overflow fp16 for the first 14 of its 20 iterations. From
#     2^20 the first 3 overflow and are skipped while the scale backs off to 2^18 (and one
#     more, later, halves it again).
#   * added: --optimizer muon --canzona, with --use-distributed-optimizer, which it needs.
#   * on a machine without CUDA pretrain_gpt.py runs on CPU: gloo instead of NCCL and
#     Megatron-Core's local layers instead of transformer-engine's, whose attention is the
#     unfused one whatever --attention-backend says. fp16 runs on CPU as well.
#   * Megatron-Core 0.19.2 parses --rampup-batch-size but no longer acts on it;
#     pretrain_gpt.py runs it as the equivalent --step-batch-size-schedule (it says so).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"

CHECKPOINT_PATH="$ROOT/build/gpt3-tiny/checkpoints"
TENSORBOARD_LOGS_PATH="$ROOT/build/gpt3-tiny/tensorboard"
if [[ $# -gt 0 && "$1" != -* ]]; then CHECKPOINT_PATH="$1"; shift; fi
if [[ $# -gt 0 && "$1" != -* ]]; then TENSORBOARD_LOGS_PATH="$1"; shift; fi

# 4 ranks: TP 2 x PP 2 leaves DP 1. One torch thread per rank: on a small CPU machine more
# threads would only fight over the cores.
GPUS_PER_NODE=4
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes 1
    --master-addr localhost
    --master-port "${MASTER_PORT:-6000}"
)

GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8
    --rampup-batch-size 2 2 48
    --train-iters 20
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --initial-loss-scale 1048576
    --lr 6.0e-4
    --lr-decay-style cosine
    --min-lr 6.0e-5
    --lr-warmup-fraction .001
    --lr-decay-iters 18
    --optimizer muon
    --canzona
    --use-distributed-optimizer
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
)

DATA_ARGS=(
    --mock-data
    --tokenizer-type NullTokenizer
    --vocab-size 512
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 5
    --eval-interval 5
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --eval-iters 2
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "$@"
