#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine's loopback, running the qwen3-tiny recipe
# through examples/qwen3/slurm_pretrain.sbatch twice: a job that trains and saves a
# checkpoint, then a job that loads it and continues. Checks both, then takes everything down.
#
#   tools/slurm_local.sh            # ~1-2 minutes on 2 cores once SLURM is installed
#   KEEP=1 tools/slurm_local.sh     # leave the work directory (logs, slurm.conf) behind
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge with apt-get when they are
# missing. Needs root (slurmd does). Exit status: 0 passed, 1 failed, 77 skipped (not root, or
# SLURM is not installed and apt-get cannot install it: the reason is printed).
#
# Environment: SLURM_LOCAL_DIR (work directory; default a new one under /tmp),
# SLURM_LOCAL_JOB_TIMEOUT_S (per job, default 240), TRAIN_ITERS (first job; the resume job
# trains 2 more), PYTHON.
#
# Everything it starts (munged, slurmctld, slurmd, the jobs) runs with SLURM_CONF pointing
# into the work directory; on exit, also after a failure or Ctrl-C, the jobs are cancelled,
# the daemons stopped by PID, any process still carrying that SLURM_CONF killed, and the
# work directory removed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOB_TIMEOUT_S="${SLURM_LOCAL_JOB_TIMEOUT_S:-240}"
FIRST_ITERS="${TRAIN_ITERS:-4}"
SAVE_INTERVAL=2
RESUME_ITERS=$(( FIRST_ITERS + 2 ))
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
KillWait=5
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

# submit NAME TRAIN_ITERS [pretrain_gpt.py flags...]: prints the job id
submit() {
    local name="$1" iters="$2"
    shift 2
    TRAIN_ITERS="$iters" WARMUP_ITERS=1 SAVE_INTERVAL="$SAVE_INTERVAL" LOG_INTERVAL=1 EVAL_INTERVAL=1000 \
        CKPT_DIR="$WORK/checkpoints" LOG_DIR="$WORK/run" NPROC_PER_NODE=2 VARIANT=adamw \
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

run_jobs() {
    local id iteration
    id="$(submit train "$FIRST_ITERS")"
    log "submitted job $id: qwen3-tiny, $FIRST_ITERS iterations, checkpoint every $SAVE_INTERVAL"
    wait_job "$id" train
    check_log train "iteration +$FIRST_ITERS/ +$FIRST_ITERS \|" "training did not reach iteration $FIRST_ITERS"
    check_log train "\[slurm\] master [^ ]+:[0-9]+" "the sbatch script printed no rendezvous"
    iteration="$(tracker_iteration)"
    [[ "$iteration" == "$FIRST_ITERS" ]] \
        || fail "latest_checkpointed_iteration.txt says $iteration, expected $FIRST_ITERS"
    [[ -d "$WORK/checkpoints/iter_$(printf '%07d' "$FIRST_ITERS")" ]] \
        || fail "no checkpoint directory iter_$(printf '%07d' "$FIRST_ITERS")"
    log "checkpoint of iteration $iteration written"

    # The resume job loads the model, iteration and data position but not the AdamW moments
    # (--no-load-optim): without apex or transformer-engine, Megatron-Core 0.19.2's
    # distributed optimizer cannot rebuild its state dict for loading (no 'step' entry).
    id="$(submit resume "$RESUME_ITERS" --no-load-optim)"
    log "submitted job $id: resume to $RESUME_ITERS iterations"
    wait_job "$id" resume
    check_log resume "loading checkpoint from .* at iteration $FIRST_ITERS" "the checkpoint was not loaded"
    check_log resume "iteration +$(( FIRST_ITERS + 1 ))/ +$RESUME_ITERS \|" \
        "training did not continue at iteration $(( FIRST_ITERS + 1 ))"
    if grep -qE "iteration +1/ +$RESUME_ITERS \|" "$WORK/jobs/resume.out"; then
        fail "the resume job started again from iteration 1"
    fi
    iteration="$(tracker_iteration)"
    [[ "$iteration" == "$RESUME_ITERS" ]] \
        || fail "after the resume job latest_checkpointed_iteration.txt says $iteration, expected $RESUME_ITERS"
    log "resumed at iteration $(( FIRST_ITERS + 1 )) and saved iteration $iteration"
}

install_slurm
write_config
start_daemons
run_jobs
log "PASS"
