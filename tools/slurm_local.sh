#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine's loopback, running the qwen3-tiny recipe
# (VARIANT=canzona: Muon with --canzona; CKPT_FORMAT=torch_dist) through
# examples/qwen3/slurm_pretrain.sbatch three times, all with --train-iters TOTAL:
#   train     stops at iteration FIRST (--exit-interval, exit status 0) after saving it;
#   resume    loads that checkpoint with its optimizer state and trains FIRST+1..TOTAL;
#   straight  trains 1..TOTAL in one go, without checkpoints.
# Checks the logs and checkpoints of the first two; that the lm loss and grad norm Megatron
# prints for each iteration of train + resume are the straight job's, line for line and
# digit for digit, and so are the final validation and test losses; then takes everything
# down. Then a fourth job, requeued while it trains without an exit-signal handler, must take
# over its own --save lock; a fifth, requeued then cancelled with the recipe's handler, must save
# a checkpoint each time and resume from the first.
#
#   tools/slurm_local.sh            # ~90 s on 2 cores once SLURM is installed (four jobs)
#   KEEP=1 tools/slurm_local.sh     # leave the work directory (logs, slurm.conf) behind
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge with apt-get when they are
# missing. Needs root (slurmd does). Exit status: 0 passed, 1 failed, 77 skipped (not root, or
# SLURM is not installed and apt-get cannot install it: the reason is printed).
#
# Environment: SLURM_LOCAL_DIR (work directory; default a new one under /tmp),
# SLURM_LOCAL_JOB_TIMEOUT_S (per job, default 240), TRAIN_ITERS (TOTAL, default 6),
# FIRST_ITERS (where the train job stops, default TOTAL - 3), PYTHON.
#
# Everything it starts (munged, slurmctld, slurmd, the jobs) runs with SLURM_CONF pointing
# into the work directory; on exit, also after a failure or Ctrl-C, the jobs are cancelled,
# the daemons stopped by PID, any process still carrying that SLURM_CONF killed, and the
# work directory removed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOB_TIMEOUT_S="${SLURM_LOCAL_JOB_TIMEOUT_S:-240}"
SAVE_INTERVAL=2
TOTAL_ITERS="${TRAIN_ITERS:-6}"
[[ "$TOTAL_ITERS" =~ ^[0-9]+$ ]] || { echo "slurm_local.sh: error: TRAIN_ITERS=$TOTAL_ITERS is not a number" >&2; exit 2; }
FIRST_ITERS="${FIRST_ITERS:-$(( TOTAL_ITERS > 3 ? TOTAL_ITERS - 3 : 1 ))}"
if ! [[ "$FIRST_ITERS" =~ ^[0-9]+$ ]] || (( FIRST_ITERS < 1 || FIRST_ITERS >= TOTAL_ITERS )); then
    echo "slurm_local.sh: error: need 1 <= FIRST_ITERS < TRAIN_ITERS (got $FIRST_ITERS and $TOTAL_ITERS)" >&2
    exit 2
fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
if [[ -n "${SLURM_LOCAL_DIR:-}" ]]; then
    WORK="$SLURM_LOCAL_DIR"
    mkdir -p "$WORK"
else
    WORK="$(mktemp -d /tmp/canzona-slurm.XXXXXX)"
fi
WORK="$(cd "$WORK" && pwd)"
export SLURM_CONF="$WORK/etc/slurm.conf"
DAEMON_PIDS=()
START=$(date +%s)

log() { echo "[slurm_local +$(( $(date +%s) - START ))s] $*"; }
fail() { log "FAIL: $*"; exit 1; }

# --- teardown ----------------------------------------------------------------------------

# PIDs of processes whose environment holds this run's SLURM_CONF (daemons and jobs alike).
pids_of_this_run() {
    local environ pid
    for environ in /proc/[0-9]*/environ; do
        pid="${environ#/proc/}"
        pid="${pid%/environ}"
        [[ "$pid" == "$$" || "$pid" == "$BASHPID" ]] && continue
        if { tr '\0' '\n' < "$environ"; } 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF"; then
            echo "$pid"
        fi
    done
}

stop_pid() {  # SIGTERM, up to 10 s, then SIGKILL
    local pid="$1" i
    kill -TERM "$pid" 2>/dev/null || return 0
    for (( i = 0; i < 100; i++ )); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
}

teardown() {
    local status=$? pid
    trap - EXIT INT TERM
    (( status == 0 || status == 77 )) || log "exit status $status: cancelling jobs, stopping daemons"
    if [[ -f "$SLURM_CONF" ]] && (( ${#DAEMON_PIDS[@]} > 0 )); then
        scancel --quiet --full --user="$(id -un)" 2>/dev/null || true
        # Give slurmd a moment to end the job steps itself before the daemons go.
        for _ in 1 2 3 4 5 6 7 8 9 10; do
            [[ -z "$(squeue --noheader 2>/dev/null)" ]] && break
            sleep 0.5
        done
    fi
    for (( i = ${#DAEMON_PIDS[@]} - 1; i >= 0; i-- )); do
        stop_pid "${DAEMON_PIDS[i]}"
    done
    for pid in $(pids_of_this_run); do
        kill -KILL "$pid" 2>/dev/null || true
    done
    if [[ "${KEEP:-0}" == 1 ]]; then
        log "work directory kept: $WORK"
    else
        rm -rf "$WORK"
    fi
    exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- install -------------------------------------------------------------------------------

have_slurm() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null
}

install_slurm() {
    if [[ "$(id -u)" != 0 ]]; then
        log "SKIP: slurmd runs jobs as their users and needs root, as does apt-get"
        exit 77
    fi
    have_slurm && return 0
    if ! command -v apt-get >/dev/null; then
        log "SKIP: SLURM is not installed and there is no apt-get to install it"
        exit 77
    fi
    local packages=(slurmctld slurmd slurm-client munge)
    log "installing ${packages[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends "${packages[@]}" > "$WORK/apt.log" 2>&1; then
        apt-get update -q >> "$WORK/apt.log" 2>&1 || true
        if ! apt-get install -y -q --no-install-recommends "${packages[@]}" >> "$WORK/apt.log" 2>&1; then
            log "SKIP: apt-get could not install ${packages[*]}:"
            tail -n 5 "$WORK/apt.log"
            exit 77
        fi
    fi
    have_slurm || fail "apt-get installed ${packages[*]} but the daemons are not on PATH"
}

# --- configuration -----------------------------------------------------------------------

free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

write_config() {
    local node ctld_port slurmd_port cpus
    node="$(hostname -s)"
    ctld_port="$(free_port)"
    slurmd_port="$(free_port)"
    cpus="$(nproc)"
    mkdir -p "$WORK/etc" "$WORK/munge" "$WORK/state" "$WORK/spool" "$WORK/log" "$WORK/jobs"
    chmod 755 "$WORK/munge"
    head -c 1024 /dev/urandom > "$WORK/munge/munge.key"
    chmod 400 "$WORK/munge/munge.key"
    # No cgroups, no accounting, no CPU binding: what works inside a container. Jobs run as
    # the submitting user; daemons as root (SlurmUser) on loopback ports picked free.
    cat > "$SLURM_CONF" <<EOF
ClusterName=canzona-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$WORK/munge/munge.socket
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool/slurmd-%n
SlurmctldPidFile=$WORK/state/slurmctld.pid
SlurmdPidFile=$WORK/spool/slurmd-%n.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
KillWait=15
MinJobAge=600
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
    log "slurm.conf: node $node ($cpus CPUs), slurmctld port $ctld_port, slurmd port $slurmd_port"
}

# --- daemons -------------------------------------------------------------------------------

start_daemons() {
    # munged refuses to run as root without --force; its socket and key stay in $WORK.
    munged --foreground --force --key-file="$WORK/munge/munge.key" \
        --socket="$WORK/munge/munge.socket" --pid-file="$WORK/munge/munged.pid" \
        --log-file="$WORK/log/munged.log" --seed-file="$WORK/munge/munged.seed" \
        > "$WORK/log/munged.out" 2>&1 &
    DAEMON_PIDS+=($!)
    wait_for 10 "munged's socket" test -S "$WORK/munge/munge.socket"
    slurmctld -D -i -f "$SLURM_CONF" > "$WORK/log/slurmctld.out" 2>&1 &
    DAEMON_PIDS+=($!)
    slurmd -D -f "$SLURM_CONF" -N "$(hostname -s)" > "$WORK/log/slurmd.out" 2>&1 &
    DAEMON_PIDS+=($!)
    wait_for 60 "the node to be idle" node_idle
    log "munged, slurmctld and slurmd up (PIDs ${DAEMON_PIDS[*]})"
}

node_idle() {
    [[ "$(sinfo --noheader --Node --format=%T 2>/dev/null)" == idle ]]
}

wait_for() {  # SECONDS WHAT COMMAND...
    local seconds="$1" what="$2" i
    shift 2
    for (( i = 0; i < seconds * 4; i++ )); do
        "$@" && return 0
        for pid in "${DAEMON_PIDS[@]}"; do
            kill -0 "$pid" 2>/dev/null || { show_daemon_logs; fail "a daemon (PID $pid) exited while waiting for $what"; }
        done
        sleep 0.25
    done
    show_daemon_logs
    fail "no $what after $seconds s"
}

show_daemon_logs() {
    local f
    for f in "$WORK"/log/*; do
        [[ -s "$f" ]] || continue
        echo "--- $f (last lines)"
        tail -n 15 "$f"
    done
}

# --- jobs ----------------------------------------------------------------------------------

# submit NAME CKPT_DIR LOG_DIR [pretrain_gpt.py flags...]: prints the job id. Every job is
# the same TOTAL_ITERS-iteration run of Muon with --canzona (same lr schedule, seed, data).
submit() {
    local name="$1" ckpt_dir="$2" log_dir="$3"
    shift 3
    TRAIN_ITERS="$TOTAL_ITERS" WARMUP_ITERS=1 SAVE_INTERVAL="$SAVE_INTERVAL" LOG_INTERVAL=1 EVAL_INTERVAL=1000 \
        CKPT_DIR="$ckpt_dir" CKPT_FORMAT=torch_dist LOG_DIR="$log_dir" NPROC_PER_NODE=2 VARIANT=canzona \
        PYTHON="$PYTHON" CANZONA_ROOT="$ROOT" \
        sbatch --parsable --job-name="canzona-$name" --chdir="$ROOT" --time=10 \
        --output="$WORK/jobs/$name.out" \
        "$ROOT/examples/qwen3/slurm_pretrain.sbatch" examples/qwen3/pretrain_qwen3_tiny.sh "$@"
}

job_state() {
    scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2
}

# wait_job ID NAME: waits for the job to end, fails unless it COMPLETED
wait_job() {
    local id="$1" name="$2" state="" deadline=$(( $(date +%s) + JOB_TIMEOUT_S ))
    while (( $(date +%s) < deadline )); do
        state="$(job_state "$id")"
        case "$state" in
            COMPLETED) log "job $id ($name) COMPLETED"; return 0 ;;
            FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|PREEMPTED|DEADLINE)
                show_job "$id" "$name"
                fail "job $id ($name) ended $state" ;;
        esac
        sleep 1
    done
    show_job "$id" "$name"
    fail "job $id ($name) still ${state:-unknown} after $JOB_TIMEOUT_S s"
}

show_job() {
    scontrol show job "$1" 2>/dev/null | grep -E 'JobState|ExitCode|Reason' || true
    echo "--- job output $WORK/jobs/$2.out (last lines)"
    tail -n 40 "$WORK/jobs/$2.out" 2>/dev/null || true
    show_daemon_logs
}

check_log() {  # NAME PATTERN WHAT
    if ! grep -qE "$2" "$WORK/jobs/$1.out"; then
        echo "--- job output $WORK/jobs/$1.out (last lines)"
        tail -n 40 "$WORK/jobs/$1.out"
        fail "$1: $3 (no /$2/ in the job output)"
    fi
}

tracker_iteration() {
    cat "$WORK/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo none
}

# iteration_stats NAME: "ITERATION LM_LOSS GRAD_NORM" for each of Megatron's iteration lines in
# the job output, as printed (`iteration    5/    6 | ... | lm loss: 6.867850E+00 | ... |
# grad norm: 0.868 | ...`).
iteration_stats() {
    sed -nE "s/.* iteration +([0-9]+)\/ +$TOTAL_ITERS \|.*\| lm loss: ([^ |]+) \|.*\| grad norm: ([^ |]+) \|.*/\1 \2 \3/p" \
        "$WORK/jobs/$1.out"
}

# final_eval NAME: the validation and test loss lines printed after the last iteration
final_eval() {
    grep -E "^ *validation loss at iteration $TOTAL_ITERS on (validation|test) set" "$WORK/jobs/$1.out" \
        | sed -E 's/^ +//; s/ +\| *$//'
}

check_checkpoint() {  # ITERATION WHEN
    local iteration
    iteration="$(tracker_iteration)"
    [[ "$iteration" == "$1" ]] \
        || fail "$2 latest_checkpointed_iteration.txt says $iteration, expected $1"
    [[ -d "$WORK/checkpoints/iter_$(printf '%07d' "$1")" ]] \
        || fail "$2 there is no checkpoint directory iter_$(printf '%07d' "$1")"
}

run_jobs() {
    local id next=$(( FIRST_ITERS + 1 )) expected actual
    # The job stops after iteration FIRST_ITERS, whose checkpoint Megatron writes before it
    # exits (at --exit-interval when not already saved at a --save-interval): status 0.
    id="$(submit train "$WORK/checkpoints" "$WORK/run" --exit-interval "$FIRST_ITERS")"
    log "submitted job $id (train): qwen3-tiny, Muon --canzona, iterations 1..$FIRST_ITERS of $TOTAL_ITERS" \
        "(--exit-interval $FIRST_ITERS), torch_dist checkpoint every $SAVE_INTERVAL"
    wait_job "$id" train
    check_log train "\[slurm\] master [^ ]+:[0-9]+" "the sbatch script printed no rendezvous"
    check_log train "iteration +$FIRST_ITERS/ +$TOTAL_ITERS \|" "training did not reach iteration $FIRST_ITERS"
    check_log train "exiting program at iteration $FIRST_ITERS" "training did not stop at --exit-interval"
    if grep -qE "iteration +$next/ +$TOTAL_ITERS \|" "$WORK/jobs/train.out"; then
        fail "train: training went on past --exit-interval $FIRST_ITERS"
    fi
    check_checkpoint "$FIRST_ITERS" "after the train job"
    log "checkpoint of iteration $FIRST_ITERS written"

    # Model, optimizer state (Canzona's Muon momenta), lr schedule, iteration and data position.
    id="$(submit resume "$WORK/checkpoints" "$WORK/run")"
    log "submitted job $id (resume): load iteration $FIRST_ITERS with its optimizer state, train to $TOTAL_ITERS"
    wait_job "$id" resume
    check_log resume "loading (distributed )?checkpoint from .* at iteration $FIRST_ITERS" "the checkpoint was not loaded"
    check_log resume "iteration +$next/ +$TOTAL_ITERS \|" "training did not continue at iteration $next"
    if grep -qE "iteration +1/ +$TOTAL_ITERS \|" "$WORK/jobs/resume.out"; then
        fail "the resume job started again from iteration 1"
    fi
    check_checkpoint "$TOTAL_ITERS" "after the resume job"
    log "resumed at iteration $next and saved iteration $TOTAL_ITERS"

    id="$(submit straight none "$WORK/run-straight")"
    log "submitted job $id (straight): iterations 1..$TOTAL_ITERS in one go, no checkpoints"
    wait_job "$id" straight
    # Every lm loss and grad norm (LOG_INTERVAL=1: one iteration each) must match as printed,
    # the line after a restart's first included (canzona_patches.integration.training resets the interval
    # sums Megatron keeps after a first iteration on the interval), and so must the losses of
    # the final evaluation.
    expected="$(iteration_stats straight)"
    actual="$( { iteration_stats train; iteration_stats resume; } )"
    if [[ "$(wc -l <<< "$expected")" != "$TOTAL_ITERS" ]]; then
        echo "--- iteration, lm loss, grad norm of the straight job"
        echo "$expected"
        fail "straight: expected an iteration line with lm loss and grad norm for each of the $TOTAL_ITERS iterations"
    fi
    if [[ "$actual" != "$expected" ]]; then
        echo "--- iteration, lm loss, grad norm: train then resume | straight"
        diff -y <(echo "$actual") <(echo "$expected") || true
        fail "the lm loss or grad norm of train + resume differs from the straight job's"
    fi
    expected="$(final_eval straight)"
    actual="$(final_eval resume)"
    if [[ "$(wc -l <<< "$expected")" != 2 || "$actual" != "$expected" ]]; then
        echo "--- final evaluation of the resume job"
        echo "$actual"
        echo "--- final evaluation of the straight job"
        echo "$expected"
        fail "the final validation and test losses of the resume job differ from the straight job's"
    fi
    log "train + resume match the straight job: lm loss and grad norm of iterations 1..$TOTAL_ITERS," \
        "validation and test loss"
    iteration_stats resume | while read -r iteration loss grad_norm; do
        log "  iteration $iteration: lm loss $loss, grad norm $grad_norm (resume)"
    done
}

# wait_output NAME PATTERN WHAT: waits until the job's output matches PATTERN
wait_output() {
    local deadline=$(( $(date +%s) + JOB_TIMEOUT_S ))
    while (( $(date +%s) < deadline )); do
        grep -qE "$2" "$WORK/jobs/$1.out" 2>/dev/null && return 0
        sleep 1
    done
    echo "--- job output $WORK/jobs/$1.out (last lines)"
    tail -n 40 "$WORK/jobs/$1.out" 2>/dev/null || true
    fail "$1: $3 (no /$2/ within $JOB_TIMEOUT_S s)"
}

# A job requeued while it trains (scontrol requeue; a node failure) is the same job: its
# second start must take over the --save directory's lock that the first one, killed, could
# not remove (megatron/canzona/runtime/save_lock.py), and train on. Without an exit-signal
# handler (EXIT_SIGNAL=none) the requeue's SIGTERM ends the ranks at once, saying in one line
# that nothing was saved.
requeue_job() {
    local id
    id="$(EXIT_SIGNAL=none submit requeue "$WORK/checkpoints-requeue" "$WORK/run-requeue" --train-iters 100000)"
    log "submitted job $id (requeue): trains until it is requeued, no exit-signal handler"
    wait_output requeue "iteration +3/ +100000 \|" "the job did not start training"
    requeue_now "$id"
    log "requeued job $id while it trained"
    wait_output requeue "\[slurm\] job $id \(restart 1\)" "the job did not start again"
    check_log requeue "pretrain_gpt\.py: error: stopped by SIGTERM after iteration [0-9]+: nothing was saved .*--exit-signal-handler" \
        "the first start did not say that the requeue's SIGTERM saved nothing"
    wait_output requeue "\[canzona\] took over the lock of --save .*: the same SLURM job $id, requeued" \
        "the requeued job did not take over its own save-directory lock"
    wait_output requeue "iteration +[0-9]+/ +100000 \|" "the requeued job did not train"
    scancel "$id"
    log "job $id, restarted, took over its save-directory lock and trained on; cancelled"
}

requeue_now() {  # ID: requeue a running job and let it start again at once
    scontrol requeue "$1" || fail "scontrol requeue $1 failed"
    # slurmctld holds a requeued batch job back for a while (BeginTime); let it start now.
    wait_for 60 "job $1 pending again" bash -c "[[ \"\$(scontrol show job $1 | grep -o 'JobState=[A-Z]*')\" == JobState=PENDING ]]"
    scontrol update JobId="$1" StartTime=now || true
}

saved_after_sigterm() {  # JOB_OUTPUT: the iteration of the last save before Megatron's exit on the first SIGTERM
    # (the save of the iteration under way when the signal came may be the periodic one, the exit's the next)
    awk '/\[canzona\] SIGTERM after iteration/ { stopped = 1 }
         stopped && match($0, /successfully saved checkpoint from iteration +[0-9]+/) {
             n = split(substr($0, RSTART, RLENGTH), words, " "); last = words[n] + 0 }
         stopped && /exiting program after receiving SIGTERM/ { print last; exit }' "$1"
}

# Preemption: SLURM ends a job with SIGTERM (scontrol requeue, scancel, a preempting job), and
# under the recipe's --exit-signal-handler every rank saves a checkpoint at the next iteration
# boundary and exits; the requeued start resumes from it, and a scancel saves again.
preempted_job() {
    local id saved cancelled
    id="$(submit preempted "$WORK/checkpoints-preempted" "$WORK/run-preempted" --train-iters 100000)"
    log "submitted job $id (preempted): trains until it is requeued, then cancelled"
    wait_output preempted "iteration +3/ +100000 \|" "the job did not start training"
    requeue_now "$id"
    wait_output preempted "\[slurm\] job $id \(restart 1\)" "the job did not start again"
    check_log preempted "\[canzona\] SIGTERM after iteration [0-9]+: every rank saves a checkpoint" \
        "the first start did not take the requeue's SIGTERM as a stop to save at"
    saved="$(saved_after_sigterm "$WORK/jobs/preempted.out")"
    [[ -n "$saved" ]] || fail "preempted: the first start saved no checkpoint on SIGTERM"
    wait_output preempted "loading (distributed )?checkpoint from .* at iteration $saved" \
        "the requeued job did not resume from the checkpoint its first start saved (iteration $saved)"
    wait_output preempted "iteration +$(( saved + 1 ))/ +100000 \|" "the requeued job did not train on from iteration $saved"
    log "job $id saved iteration $saved on the requeue's SIGTERM, and its restart resumed from it"
    scancel "$id"
    wait_for 60 "job $id to end" bash -c "[[ \"\$(scontrol show job $id | grep -o 'JobState=[A-Z]*')\" == JobState=CANCELLED ]]"
    wait_for 30 "the cancelled job's checkpoint" bash -c \
        "(( \$(cat '$WORK/checkpoints-preempted/latest_checkpointed_iteration.txt') > $saved ))"
    cancelled="$(cat "$WORK/checkpoints-preempted/latest_checkpointed_iteration.txt")"
    log "scancel: job $id saved iteration $cancelled before it ended"
}

install_slurm
write_config
start_daemons
run_jobs
requeue_job
preempted_job
log "PASS"
