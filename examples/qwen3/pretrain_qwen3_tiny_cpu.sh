#!/usr/bin/env bash
# Pretrain qwen3-tiny on CPU: 4 gloo ranks (TP 1 x DP 4), 200 iterations, then plot the loss.
#
#   examples/qwen3/pretrain_qwen3_tiny_cpu.sh                    # Muon with --canzona (the default)
#   OPTIMIZER=soap examples/qwen3/pretrain_qwen3_tiny_cpu.sh      # shampoo | soap | muon, with --canzona
#   OPTIMIZER=adam CANZONA=0 examples/qwen3/pretrain_qwen3_tiny_cpu.sh   # AdamW, Megatron's distributed optimizer
#   OPTIMIZER=muon CANZONA=0 examples/qwen3/pretrain_qwen3_tiny_cpu.sh   # Megatron's layer-wise Muon
#   TP=2 examples/qwen3/pretrain_qwen3_tiny_cpu.sh               # TP 2 x DP 2
#   FSDP=optim_grads_params examples/qwen3/pretrain_qwen3_tiny_cpu.sh   # Megatron-FSDP instead of the
#                  distributed optimizer (optim | optim_grads | optim_grads_params; docs/fsdp.md)
#   examples/qwen3/pretrain_qwen3_tiny_cpu.sh --bf16             # extra flags go last
#   OVERLAP_PARAM_GATHER=0 examples/qwen3/pretrain_qwen3_tiny_cpu.sh   # parameter all-gather in the step
#   OVERLAP_GRAD_REDUCE=0 examples/qwen3/pretrain_qwen3_tiny_cpu.sh    # no collective overlapped at all
#
# Makes data/demo/ first if it is missing (tools/prepare_demo_data.py, ~10 s). Writes
# $OUT_DIR/{train.log,metrics.jsonl,loss.png} (default build/qwen3-tiny-cpu/, not tracked).
# qwen3-tiny is megatron/canzona/planning/qwen3.py's entry: 2 layers, hidden 64, SwiGLU ffn
# 176, 4 heads in 2 query groups of head dim 16, QK RMSNorm, RoPE base 1e6, untied output
# layer, vocabulary 1024 (the demo tokenizer's). About a minute on 2 cores.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-4}"
TP="${TP:-1}"
ITERS="${ITERS:-200}"
OPTIMIZER="${OPTIMIZER:-muon}"
CANZONA="${CANZONA:-1}"
OVERLAP_ARGS=(--overlap-grad-reduce --overlap-param-gather)
if [[ "${OVERLAP_GRAD_REDUCE:-1}" == 0 ]]; then
    OVERLAP_ARGS=()
elif [[ "${OVERLAP_PARAM_GATHER:-1}" == 0 ]]; then
    OVERLAP_ARGS=(--overlap-grad-reduce)
fi
# The distributed optimizer (ZeRO-1), or Megatron-FSDP's shards of weights, gradients and optimizer state.
SHARDING_ARGS=(--use-distributed-optimizer)
SHARDING_LABEL=""
if [[ -n "${FSDP:-}" ]]; then
    case "$FSDP" in
        optim|optim_grads|optim_grads_params) ;;
        *) echo "FSDP=$FSDP is not one of optim, optim_grads, optim_grads_params" >&2; exit 2 ;;
    esac
    if [[ "$OPTIMIZER" == muon && "${CANZONA:-1}" != 1 ]]; then
        echo "FSDP=$FSDP: Megatron's own Muon does not run under Megatron-FSDP; leave CANZONA=1 or use OPTIMIZER=adam" >&2
        exit 2
    fi
    SHARDING_ARGS=(--use-megatron-fsdp --data-parallel-sharding-strategy "$FSDP" --ckpt-format fsdp_dtensor)
    SHARDING_LABEL=", Megatron-FSDP $FSDP"
fi
CANZONA_FLAGS=()
LABEL="qwen3-tiny $OPTIMIZER"
if [[ "$CANZONA" == 1 ]]; then
    CANZONA_FLAGS=(--canzona)
    LABEL="$LABEL --canzona"
fi
OUT_DIR="${OUT_DIR:-$ROOT/build/qwen3-tiny-cpu}"
DATA_DIR="$ROOT/data/demo"

if [[ ! -f "$DATA_DIR/demo_text_document.idx" || ! -f "$DATA_DIR/tokenizer.model" ]]; then
    "$PYTHON" tools/prepare_demo_data.py --output-dir "$DATA_DIR" > /dev/null
fi
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR/metrics.jsonl"  # the metrics file is appended to; start this run afresh

# One torch thread per rank: 4 ranks share 2 cores, more threads would only thrash.
export OMP_NUM_THREADS=1

MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 176
    --num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --qk-layernorm --disable-bias-linear
    --position-embedding-type rope --rotary-base 1000000 --untie-embeddings-and-output-weights
    --seq-length 128 --max-position-embeddings 128
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS"
    --optimizer "$OPTIMIZER" "${CANZONA_FLAGS[@]}" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    "${SHARDING_ARGS[@]}" "${OVERLAP_ARGS[@]}"
)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --distributed-backend gloo)
DATA_ARGS=(
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA_DIR/tokenizer.model"
    --data-path "$DATA_DIR/demo_text_document" --split 949,50,1
    --data-cache-path "$OUT_DIR/cache" --num-workers 0
)
LOGGING_ARGS=(
    --log-interval 10 --eval-interval 100 --eval-iters 4
    --canzona-metrics-file "$OUT_DIR/metrics.jsonl"
)

start=$(date +%s)
"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@" 2>&1 | tee "$OUT_DIR/train.log" \
    | grep --line-buffered -E "iteration +[0-9]+/|validation loss|error:|Error|Traceback"
echo "training wall time: $(( $(date +%s) - start )) s (log: $OUT_DIR/train.log)"

"$PYTHON" tools/plot_loss.py "$OUT_DIR/metrics.jsonl" --label "$LABEL, TP $TP x DP $(( NPROC / TP ))$SHARDING_LABEL" \
    --title "qwen3-tiny on CPU (seq 128, global batch 16)" --output "$OUT_DIR/loss.png"
