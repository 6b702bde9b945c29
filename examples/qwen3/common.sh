# shellcheck shell=bash
# Shared flags and launcher of the Qwen3 recipes (examples/qwen3/pretrain_qwen3_*.sh).
#
# A recipe sets MODEL (a name of the catalog, megatron/canzona/planning/qwen3.py, whose
# architecture qwen3_architecture reads: NUM_LAYERS, HIDDEN_SIZE, ..., and NUM_EXPERTS,
# MOE_TOPK, MOE_FFN_HIDDEN_SIZE for a mixture of experts; on CPU it adds MOE_GROUPED_GEMM=0)
# and its defaults for the layout and batch, sources this file and calls
# `qwen3_recipe_main "$@"` (a CPU recipe: `qwen3_cpu_main "$@"`). Arguments go to
# pretrain_gpt.py last, so they win over every flag below.
#
# Environment (all optional):
#   VARIANT        canzona (default): --optimizer $OPTIMIZER --canzona, asynchronous TP compute
#                  sync:      --canzona --canzona-tp-mode sync (every TP rank computes every matrix)
#                  layerwise: Megatron-Core's own layer-wise distributed Muon, no --canzona
#                  adamw:     --optimizer adam with Megatron's distributed optimizer
#   OPTIMIZER      matrix optimizer of canzona/sync/layerwise: muon (default) | shampoo | soap
#   TP PP          tensor / pipeline parallel sizes (the recipe's defaults suit 8-GPU nodes)
#   CP             context-parallel size (default 1): each sequence cut over CP GPUs, for long
#                  contexts (pretrain_qwen3_8b_32k.sh); SEQ_LENGTH must be a multiple of 2 x CP
#   PP_FIRST_LAYERS PP_LAST_LAYERS   layers of the first / last pipeline stage when the layers
#                  do not split evenly (the other stages share the rest equally)
#   FSDP           a Megatron-FSDP sharding strategy (optim | optim_grads | optim_grads_params):
#                  --use-megatron-fsdp --data-parallel-sharding-strategy $FSDP instead of the
#                  distributed optimizer, fsdp_dtensor checkpoints (pretrain_qwen3_8b_fsdp.sh;
#                  variants canzona, sync and adamw: Megatron's layer-wise Muon refuses FSDP;
#                  with canzona and sync PP stays 1; CP and EP any, ETP 1)
#   EP ETP         MoE recipes (NUM_EXPERTS set) only: expert-parallel size (default 1) and
#                  expert-tensor-parallel size (default 1, the only size canzona and sync take:
#                  Canzona does not split expert matrices over TP ranks)
#   SEQ_LENGTH GLOBAL_BATCH MICRO_BATCH TRAIN_ITERS LR MIN_LR WARMUP_ITERS PRECISION(bf16|fp32)
#   DATA_PATH      indexed dataset prefix (<prefix>.bin/.idx, from tools/preprocess_data.py)
#   SPLIT          train,validation,test weights of its documents (default 989,10,1)
#   TOKENIZER_TYPE TOKENIZER_MODEL   the tokenizer the dataset was made with; TOKENIZER_MODEL is a
#                  local path (default data/tokenizers/Qwen3-8B, a Hugging Face tokenizer directory:
#                  the ranks run with HF_HUB_OFFLINE=1 and never contact the hub; README.md says how
#                  to fetch it once)
#   DATA_CACHE     where rank 0 writes the dataset's sample index and every other rank reads it:
#                  a directory every node sees (default: cache/ beside the DATA_PATH files)
#   CKPT_DIR       --save and --load directory: a requeued job resumes from its latest checkpoint
#                  (CKPT_DIR=none: no checkpoints)
#   SAVE_INTERVAL CKPT_FORMAT(torch_dist|torch; fsdp_dtensor with FSDP) LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS
#   LOG_DIR        metrics.jsonl (default build/<model>-<variant>; checkpoints go to its
#                  checkpoints/ unless CKPT_DIR is set)
#   DIST_TIMEOUT_MINUTES  how long a collective waits for its peers (default 30)
#   GC_INTERVAL    iterations between the ranks' joint garbage collections (default 100)
#   SHUTDOWN_TIMEOUT  seconds torchrun gives its ranks to exit after relaying a signal before it
#                  kills them (default 150: SIGUSR1 comes 180 s before the SLURM time limit)
#   EXIT_SIGNAL    the signal that makes every rank save a checkpoint and exit (default SIGUSR1,
#                  which slurm_pretrain.sbatch sends before the time limit; SIGTERM, what scancel
#                  and preemption send, does the same under --exit-signal-handler); none: no
#                  --exit-signal-handler, a signal ends the job without saving
#   NPROC_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT   torchrun's rendezvous; under
#                  SLURM (slurm_pretrain.sbatch) NNODES and NODE_RANK come from SLURM_NNODES
#                  and SLURM_NODEID, the master from the sbatch script
#   PYTHON         interpreter (default .venv/bin/python of the repository, else python3)
#   ENTRY          the script torchrun runs (default pretrain_gpt.py of the repository); one that
#                  wraps it, e.g. canzona_patches/harness/pretrain_with_fault.py, which arms a test
#                  fault (tools/chaos.py)
#   NCCL_* GLOO_SOCKET_IFNAME   the network of the collectives (README.md): passed on when set
#   DRY_RUN=1      print the command (`env [VAR=value...] python -m torch.distributed.run ...`,
#                  shell-quoted, one line) and exit, without looking for the data or tokenizer
#
# On a machine without CUDA pretrain_gpt.py runs on CPU with gloo (it switches NCCL and the
# fused kernels off by itself); only pretrain_qwen3_tiny.sh and pretrain_qwen3_moe_tiny.sh are
# small enough for that.

QWEN3_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

qwen3_die() {
    echo "$(basename "$0"): error: $*" >&2
    exit 2
}

# Flags of the optimizer setup being compared; Muon's settings are the same for every
# variant so that only the distribution differs (momentum 0.95, 5 quintic Newton-Schulz
# steps, update scaled by 0.2*sqrt(max(m, n)) so its RMS matches AdamW's: Megatron's
# "spectral" mode is sqrt(max(m, n)), the 0.2 is the extra factor).
qwen3_optimizer_args() {
    local optimizer="${OPTIMIZER:-muon}"
    local muon=(--muon-momentum 0.95 --muon-num-ns-steps 5 --muon-coefficient-type quintic
                --muon-scale-mode spectral --muon-extra-scale-factor 0.2)
    case "${VARIANT:-canzona}" in
        canzona) OPTIMIZER_ARGS=(--optimizer "$optimizer" --canzona --canzona-tp-mode async "${muon[@]}") ;;
        sync) OPTIMIZER_ARGS=(--optimizer "$optimizer" --canzona --canzona-tp-mode sync "${muon[@]}") ;;
        # Megatron's layer-wise optimizer; "duplicated" gathers each TP-sharded matrix and
        # runs Newton-Schulz on the whole of it (the same math as Canzona, computed on
        # every TP rank) rather than on the local shard ("blockwise", its default).
        layerwise) OPTIMIZER_ARGS=(--optimizer "$optimizer" --muon-tp-mode duplicated "${muon[@]}") ;;
        adamw) OPTIMIZER_ARGS=(--optimizer adam) ;;
        *) qwen3_die "VARIANT=${VARIANT} is not one of canzona, sync, layerwise, adamw" ;;
    esac
}

# The architecture of MODEL, from the catalog (its one definition), as shell variables. Without
# MODEL, an architecture of one's own comes from the environment (NUM_LAYERS, HIDDEN_SIZE, ...),
# and only what every Qwen3 shares (norm epsilon, RoPE base, init std) from the catalog.
qwen3_architecture() {
    local assignments name value
    qwen3_python
    assignments="$("$PYTHON" -c 'import sys
from megatron.canzona.planning.qwen3 import recipe_variables
for name, value in recipe_variables(sys.argv[1] or None).items():
    print(f"{name}={value}")' "${MODEL:-}")" \
        || qwen3_die "cannot read MODEL=${MODEL:-} from the catalog with $PYTHON: name a model of" \
            "megatron/canzona/planning/qwen3.py, and install the repository (make venv, or pip install -e .)"
    if [[ -n "${MODEL:-}" ]]; then  # the catalog's architecture, whatever the environment says
        unset NUM_LAYERS NUM_EXPERTS MOE_TOPK MOE_FFN_HIDDEN_SIZE
    fi
    while IFS='=' read -r name value; do
        [[ -n "$name" ]] && printf -v "$name" '%s' "$value"
    done <<< "$assignments"
    [[ -n "${NUM_LAYERS:-}" ]] || qwen3_die "no architecture: set MODEL to a model of" \
        "megatron/canzona/planning/qwen3.py, or NUM_LAYERS, HIDDEN_SIZE, ... for one of your own"
}

# PYTHON, unless set: the repository's .venv/bin/python, else python3.
qwen3_python() {
    if [[ -z "${PYTHON:-}" ]]; then
        if [[ -x "$QWEN3_ROOT/.venv/bin/python" ]]; then
            PYTHON="$QWEN3_ROOT/.venv/bin/python"
        else
            PYTHON=python3
        fi
    fi
}

# Whether the torchrun of $PYTHON's torch takes the flag $1 (torch 2.11's has no
# --shutdown-timeout). Read from torchrun's source: importing torch would cost seconds. Where
# torch cannot be found (a DRY_RUN on a login node), the flag is assumed.
qwen3_torchrun_takes() {
    local status=0
    "$PYTHON" - "$1" <<'PY' 2>/dev/null || status=$?
import importlib.util, pathlib, sys
run = pathlib.Path(importlib.util.find_spec("torch").submodule_search_locations[0], "distributed", "run.py")
sys.exit(0 if sys.argv[1].encode() in run.read_bytes() else 1)
PY
    (( status != 1 ))
}

qwen3_model_args() {
    qwen3_architecture
    # Megatron pads the tokenizer's vocabulary to a multiple of this times TP. Qwen3's
    # embedding has VOCAB_SIZE rows, a multiple of 128; with VOCAB_SIZE/128 as the divisor
    # the padded size is VOCAB_SIZE itself for every TP size that divides 128.
    local vocab_divisor=$(( VOCAB_SIZE / 128 ))
    MODEL_ARGS=(
        --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
        --num-attention-heads "$NUM_HEADS" --group-query-attention
        --num-query-groups "$NUM_QUERY_GROUPS" --kv-channels "$KV_CHANNELS"
        --normalization RMSNorm --norm-epsilon "$NORM_EPSILON" --swiglu --qk-layernorm --disable-bias-linear
        --position-embedding-type rope --rotary-base "$ROTARY_BASE"
        --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
        --make-vocab-size-divisible-by "$vocab_divisor"
        --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std "$INIT_METHOD_STD"
    )
    if [[ "$TIED_EMBEDDINGS" != 1 ]]; then
        MODEL_ARGS+=(--untie-embeddings-and-output-weights)
    fi
    if [[ -n "${NUM_EXPERTS:-}" ]]; then
        qwen3_moe_args
        MODEL_ARGS+=("${MOE_ARGS[@]}")
    fi
}

# Qwen3-MoE's mixture of experts, as its config.json sets it: every layer's MLP is
# NUM_EXPERTS SwiGLU experts of width MOE_FFN_HIDDEN_SIZE (decoder_sparse_step 1, no
# mlp_only_layers, no shared expert), each token routed to MOE_TOPK of them.
qwen3_moe_args() {
    MOE_ARGS=(
        --num-experts "$NUM_EXPERTS" --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE" --moe-layer-freq 1
        # Qwen3 takes the softmax over all experts' logits, keeps the top k and divides them by
        # their sum (norm_topk_prob). Megatron's default order, top k of the logits and then a
        # softmax over those k (no --moe-router-pre-softmax), gives exactly these probabilities:
        # exp(l_i) / sum over the top k of exp(l_j) either way.
        --moe-router-topk "$MOE_TOPK" --moe-router-score-function softmax
        # Load-balancing auxiliary loss with Qwen3's router_aux_loss_coef.
        --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
        --moe-token-dispatcher-type "${MOE_DISPATCHER:-alltoall}"
    )
    # One grouped GEMM per layer over its local experts (transformer-engine); the CPU recipe
    # runs them one after the other (MOE_GROUPED_GEMM=0).
    if [[ "${MOE_GROUPED_GEMM:-1}" == 1 ]]; then
        MOE_ARGS+=(--moe-grouped-gemm)
    fi
}

qwen3_training_args() {
    TRAINING_ARGS=(
        --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
        --train-iters "$TRAIN_ITERS"
        --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
        --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8
        --overlap-grad-reduce --overlap-param-gather
        --seed 1234
        # A NaN or Inf in the loss or the gradients stops the job at once, the error naming
        # the rank and iteration. (Megatron's default re-runs the step, then saves and exits
        # asking for a run on other GPUs to tell a hardware fault from a real divergence.)
        --rerun-mode disabled
        # Collectives wait this long for their peers: enough for rank 0 to build the sample
        # index of a large corpus while the others wait at a barrier, or for a slow checkpoint
        # save; a real hang still ends the job within it (Megatron's default is 10 minutes).
        --distributed-timeout-minutes "$DIST_TIMEOUT_MINUTES"
        # Python's garbage collector runs on all ranks at the same iterations rather than when
        # each rank's allocation count says so: a collection on one rank stalls every
        # collective waiting for it, and at hundreds of ranks one of them is always collecting.
        --manual-gc --manual-gc-interval "$GC_INTERVAL"
    )
    # The distributed optimizer (ZeRO-1), or Megatron-FSDP's shards of weights, gradients and
    # optimizer state (docs/fsdp.md).
    if [[ -z "$FSDP" ]]; then
        TRAINING_ARGS+=(--use-distributed-optimizer)
    else
        case "$FSDP" in
            optim | optim_grads | optim_grads_params) ;;
            *) qwen3_die "FSDP=$FSDP is not one of optim, optim_grads, optim_grads_params" ;;
        esac
        [[ "$VARIANT" == layerwise ]] && qwen3_die "FSDP=$FSDP: Megatron's layer-wise Muon does not run under" \
            "Megatron-FSDP; pass VARIANT=canzona, sync or adamw, or leave FSDP unset"
        if [[ "$VARIANT" == canzona || "$VARIANT" == sync ]] && (( PP > 1 )); then
            qwen3_die "FSDP=$FSDP: --canzona under Megatron-FSDP runs PP 1 (PP=$PP)"
        fi
        TRAINING_ARGS+=(--use-megatron-fsdp --data-parallel-sharding-strategy "$FSDP")
    fi
    # SIGUSR1 makes every rank finish its iteration, save a checkpoint and exit with status 0
    # (slurm_pretrain.sbatch sends it before the time limit, torchrun relays it: see
    # qwen3_launcher), and so does SIGTERM, which scancel and preemption send (pretrain_gpt.py
    # takes it as the exit signal under --exit-signal-handler). A SIGTERM with which torchrun
    # stops the surviving ranks of a failed job still stops them at once: a rank of theirs has
    # ended. Costs one 4-byte all-gather per iteration.
    if [[ "$EXIT_SIGNAL" != none ]]; then
        TRAINING_ARGS+=(--exit-signal-handler --exit-signal "$EXIT_SIGNAL")
    fi
    case "$PRECISION" in
        # Gradients are accumulated over micro-batches and reduce-scattered over DP in fp32 at
        # every DP size. A bf16 sum of DP gradients rounds to 8 mantissa bits, and its error
        # grows with the number of terms, i.e. with the node count; a rule by DP size would
        # change the numerics between the node counts the recipes compare. Megatron-Core
        # 0.19.2 already does this for bf16 unless --grad-reduce-in-bf16; the flag says so and
        # keeps it if that default changes. fp32 runs reduce in fp32 anyway.
        bf16) TRAINING_ARGS+=(--bf16 --accumulate-allreduce-grads-in-fp32) ;;
        fp32) ;;
        *) qwen3_die "PRECISION=$PRECISION is not bf16 or fp32" ;;
    esac
}

qwen3_parallel_args() {
    PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
    if (( TP > 1 )); then
        PARALLEL_ARGS+=(--sequence-parallel)
    fi
    if (( CP > 1 )); then
        (( SEQ_LENGTH % (2 * CP) == 0 )) || qwen3_die "SEQ_LENGTH=$SEQ_LENGTH is not a multiple of 2 x CP = $((2 * CP))"
        PARALLEL_ARGS+=(--context-parallel-size "$CP")
    fi
    if [[ -n "${PP_FIRST_LAYERS:-}" ]]; then
        PARALLEL_ARGS+=(--decoder-first-pipeline-num-layers "$PP_FIRST_LAYERS")
    fi
    if [[ -n "${PP_LAST_LAYERS:-}" ]]; then
        PARALLEL_ARGS+=(--decoder-last-pipeline-num-layers "$PP_LAST_LAYERS")
    fi
    if [[ -n "${NUM_EXPERTS:-}" ]]; then
        # Megatron's expert TP defaults to TP; Canzona plans each expert matrix whole on one
        # rank of its expert-data-parallel group and takes no expert TP > 1, so every variant
        # gets ETP 1 explicitly (the experts are split over EP alone, the same for all four).
        if (( ETP != 1 )) && [[ "$VARIANT" == canzona || "$VARIANT" == sync ]]; then
            qwen3_die "ETP=$ETP: VARIANT=$VARIANT (Canzona) supports expert tensor parallel size 1 only;" \
                "leave ETP unset"
        fi
        PARALLEL_ARGS+=(--expert-model-parallel-size "$EP" --expert-tensor-parallel-size "$ETP")
    fi
}

qwen3_data_args() {
    DATA_ARGS=(
        --data-path "$DATA_PATH" --split "$SPLIT"
        --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL"
        # Rank 0 builds the sample index there and every other rank, on every node, reads it.
        --data-cache-path "$DATA_CACHE" --num-workers "$NUM_WORKERS"
        # No [s, s] attention mask in the samples (16 MiB of bools per 4096-token sample, made
        # by the loader and copied to the GPU every micro-batch): the attention is causal, and
        # both transformer-engine and Megatron's local softmax (the CPU path) make that mask
        # themselves when given none.
        --no-create-attention-mask-in-dataloader
    )
}

qwen3_checkpoint_args() {
    # --load and --save name the same directory: the first run finds no checkpoint there and
    # starts from scratch, a requeued or resubmitted job continues from the latest one.
    if [[ "$CKPT_DIR" == none ]]; then
        CHECKPOINT_ARGS=()
        return
    fi
    CHECKPOINT_ARGS=(
        --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval "$SAVE_INTERVAL"
        --ckpt-format "$CKPT_FORMAT"
    )
}

qwen3_logging_args() {
    LOGGING_ARGS=(
        --log-interval "$LOG_INTERVAL" --log-throughput
        --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
        --canzona-metrics-file "$LOG_DIR/metrics.jsonl"
    )
}

# torchrun on this node (behind `env` and the variables it needs): one process per GPU,
# static rendezvous at MASTER_ADDR:MASTER_PORT
# with NNODES nodes, this one being NODE_RANK. A lone node without a master uses a free
# local port (--standalone).
qwen3_launcher() {
    local nnodes="${NNODES:-${SLURM_NNODES:-1}}"
    local node_rank="${NODE_RANK:-${SLURM_NODEID:-0}}"
    LAUNCHER=(env)
    if (( TP > 1 )); then
        # Megatron's validate_args requires it for TP > 1 before Blackwell: one CUDA work
        # queue keeps the sequence-parallel communication kernels in issue order.
        LAUNCHER+=(CUDA_DEVICE_MAX_CONNECTIONS=1)
    fi
    LAUNCHER+=(
        # Every rank loads the tokenizer from TOKENIZER_MODEL on disk; none asks the Hugging
        # Face hub (compute nodes are often offline, and hundreds of ranks asking at once
        # get rate-limited).
        HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
        # NCCL holds on to the tensors of an asynchronous collective until it is waited for,
        # instead of marking them with record_stream: a block marked so returns to the caching
        # allocator only once the allocator has polled the communication stream's event, which
        # lets memory climb under the overlapped reduce-scatter and all-gather.
        "TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"
        # Segments grow in place: the many shapes of the gathered matrices and optimizer
        # scratch tensors would otherwise fragment the caching allocator's memory.
        "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
    )
    # The network settings of the collectives, when set (examples/qwen3/README.md): the ranks
    # would inherit them anyway; naming them shows in the log what the job ran with.
    local name
    while read -r name; do
        LAUNCHER+=("$name=${!name}")
    done < <(compgen -e | grep -E '^(NCCL_[A-Z0-9_]+|GLOO_SOCKET_IFNAME)$')
    # torchrun relays SIGUSR1 to its ranks (by default the signal would end torchrun itself),
    # then gives them SHUTDOWN_TIMEOUT seconds to save a checkpoint and exit before it kills
    # them. Its ranks run in sessions of their own, so a signal to torchrun's process group
    # alone would not reach them.
    LAUNCHER+=("$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC_PER_NODE"
               --signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    if qwen3_torchrun_takes --shutdown-timeout; then
        LAUNCHER+=(--shutdown-timeout "$SHUTDOWN_TIMEOUT")
    else
        echo "$(basename "$0"): note: this torch's torchrun has no --shutdown-timeout: after a signal" \
            "the ranks get its fixed default (30 s) to save, not SHUTDOWN_TIMEOUT=$SHUTDOWN_TIMEOUT s" >&2
    fi
    if (( nnodes == 1 )) && [[ -z "${MASTER_ADDR:-}" ]]; then
        LAUNCHER+=(--standalone)
    else
        [[ -n "${MASTER_ADDR:-}" ]] || qwen3_die "NNODES=$nnodes needs MASTER_ADDR (slurm_pretrain.sbatch sets it)"
        LAUNCHER+=(--nnodes "$nnodes" --node-rank "$node_rank"
                   --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}")
    fi
}

qwen3_defaults() {
    : "${MODEL:?the recipe sets MODEL}"
    VARIANT="${VARIANT:-canzona}"
    OPTIMIZER="${OPTIMIZER:-muon}"
    PRECISION="${PRECISION:-bf16}"
    NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
    TP="${TP:-1}"
    CP="${CP:-1}"
    PP="${PP:-1}"
    EP="${EP:-1}"
    ETP="${ETP:-1}"
    SEQ_LENGTH="${SEQ_LENGTH:-4096}"
    GLOBAL_BATCH="${GLOBAL_BATCH:-128}"
    MICRO_BATCH="${MICRO_BATCH:-1}"
    TRAIN_ITERS="${TRAIN_ITERS:-2000}"
    LR="${LR:-4e-4}"
    MIN_LR="${MIN_LR:-4e-5}"
    WARMUP_ITERS="${WARMUP_ITERS:-50}"
    NUM_WORKERS="${NUM_WORKERS:-2}"
    TOKENIZER_TYPE="${TOKENIZER_TYPE:-HuggingFaceTokenizer}"
    TOKENIZER_MODEL="${TOKENIZER_MODEL:-$QWEN3_ROOT/data/tokenizers/Qwen3-8B}"
    DATA_PATH="${DATA_PATH:-$QWEN3_ROOT/data/pretrain/pretrain_text_document}"
    # Beside the dataset: a directory the dataset's readers, every node, already see.
    DATA_CACHE="${DATA_CACHE:-$(dirname "$DATA_PATH")/cache}"
    SPLIT="${SPLIT:-989,10,1}"
    LOG_DIR="${LOG_DIR:-$QWEN3_ROOT/build/$MODEL-$VARIANT}"
    CKPT_DIR="${CKPT_DIR:-$LOG_DIR/checkpoints}"
    SAVE_INTERVAL="${SAVE_INTERVAL:-500}"
    FSDP="${FSDP:-}"
    if [[ -n "$FSDP" ]]; then CKPT_FORMAT="${CKPT_FORMAT:-fsdp_dtensor}"; else CKPT_FORMAT="${CKPT_FORMAT:-torch_dist}"; fi
    LOG_INTERVAL="${LOG_INTERVAL:-10}"
    EVAL_INTERVAL="${EVAL_INTERVAL:-1000}"
    EVAL_ITERS="${EVAL_ITERS:-10}"
    DIST_TIMEOUT_MINUTES="${DIST_TIMEOUT_MINUTES:-30}"
    GC_INTERVAL="${GC_INTERVAL:-100}"
    SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-150}"
    EXIT_SIGNAL="${EXIT_SIGNAL:-SIGUSR1}"
    qwen3_python
}

# The whole command of this node, in CMD.
qwen3_command() {
    qwen3_defaults
    qwen3_model_args
    qwen3_optimizer_args
    qwen3_training_args
    qwen3_parallel_args
    qwen3_data_args
    qwen3_checkpoint_args
    qwen3_logging_args
    qwen3_launcher
    CMD=("${LAUNCHER[@]}" "${ENTRY:-$QWEN3_ROOT/pretrain_gpt.py}"
         "${MODEL_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}"
         "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@")
}

# The ranks run offline: a Hugging Face tokenizer must be a directory on disk already.
qwen3_check_tokenizer() {
    if [[ "$TOKENIZER_TYPE" != HuggingFaceTokenizer ]]; then
        [[ -e "$TOKENIZER_MODEL" ]] || qwen3_die "no tokenizer at TOKENIZER_MODEL=$TOKENIZER_MODEL"
        return 0
    fi
    if [[ ! -f "$TOKENIZER_MODEL/tokenizer_config.json" ]]; then
        qwen3_die "no Hugging Face tokenizer directory at TOKENIZER_MODEL=$TOKENIZER_MODEL" \
            "(the ranks run with HF_HUB_OFFLINE=1 and read it from disk): fetch it once where" \
            "there is internet, e.g. on a login node, to a file system every node sees:" \
            "huggingface-cli download Qwen/Qwen3-8B config.json tokenizer.json" \
            "tokenizer_config.json vocab.json merges.txt --local-dir $TOKENIZER_MODEL"
    fi
}

# The CPU recipes (pretrain_qwen3_tiny.sh, pretrain_qwen3_moe_tiny.sh): their defaults, the
# demo corpus made when it is missing (tools/prepare_demo_data.py, unless DATA_PATH names
# another one), then qwen3_recipe_main. Two gloo ranks with one torch thread each, sequence 64,
# global batch 8, fp32 (bf16 for VARIANT=layerwise), torch_dist checkpoints.
qwen3_cpu_main() {
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
    TOKENIZER_MODEL="${TOKENIZER_MODEL:-$QWEN3_ROOT/data/demo/tokenizer.model}"
    DATA_PATH="${DATA_PATH:-$QWEN3_ROOT/data/demo/demo_text_document}"
    SPLIT="${SPLIT:-949,50,1}"
    FSDP="${FSDP:-}"
    if [[ -n "$FSDP" ]]; then CKPT_FORMAT="${CKPT_FORMAT:-fsdp_dtensor}"; else CKPT_FORMAT="${CKPT_FORMAT:-torch_dist}"; fi
    SAVE_INTERVAL="${SAVE_INTERVAL:-50}"
    LOG_INTERVAL="${LOG_INTERVAL:-10}"
    EVAL_INTERVAL="${EVAL_INTERVAL:-50}"
    EVAL_ITERS="${EVAL_ITERS:-2}"
    # One torch thread per rank: the ranks share the CPU cores.
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    if [[ "${DRY_RUN:-0}" != 1 && "$DATA_PATH" == "$QWEN3_ROOT/data/demo/demo_text_document" \
          && ! -f "$DATA_PATH.idx" ]]; then
        qwen3_defaults
        "$PYTHON" "$QWEN3_ROOT/tools/prepare_demo_data.py" --output-dir "$QWEN3_ROOT/data/demo" > /dev/null
    fi
    qwen3_recipe_main "$@"
}

qwen3_recipe_main() {
    qwen3_command "$@"
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%q ' "${CMD[@]}"
        printf '\n'
        return 0
    fi
    # The ranks run in the repository root: relative paths are checked from there too.
    cd "$QWEN3_ROOT" || exit 1
    if [[ ! -f "$DATA_PATH.idx" || ! -f "$DATA_PATH.bin" ]]; then
        qwen3_die "no dataset at DATA_PATH=$DATA_PATH (.bin/.idx): tokenize a corpus with" \
            "tools/preprocess_data.py and pass its output prefix as DATA_PATH"
    fi
    qwen3_check_tokenizer
    mkdir -p "$LOG_DIR"
    local optimizer="$OPTIMIZER"
    [[ "$VARIANT" == adamw ]] && optimizer=adam
    echo "[$MODEL] variant $VARIANT ($optimizer), TP $TP x PP $PP, $NPROC_PER_NODE processes" \
        "on node ${NODE_RANK:-${SLURM_NODEID:-0}} of ${NNODES:-${SLURM_NNODES:-1}}; checkpoints: $CKPT_DIR"
    exec "${CMD[@]}"
}
