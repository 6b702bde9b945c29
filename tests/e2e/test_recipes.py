"""The Qwen3 recipes of examples/qwen3: their flags pass pretrain_gpt.py's own parsing and
validation, and they declare the architectures of megatron/canzona/planning/qwen3.py.

Each recipe runs with ``DRY_RUN=1`` (it prints its torchrun command and exits); the
pretrain_gpt.py flags of every recipe x variant then go through
``pretrain_gpt.parse_and_validate`` (Megatron's ``parse_args`` with Canzona's flags,
Canzona's checks, Megatron's ``validate_args``) in one child process, at the world sizes
of one and of eight 8-GPU nodes (Qwen3-235B-A22B, whose TP 4 x PP 8 fills 4 nodes per replica:
16 and 32 nodes). The child is this file run as a script: Megatron is
imported once, and the CPU redirects it installs stay out of pytest's process. The
environment the recipe launches with (``env VAR=...``) is the one validated, not the CPU
adaptation's. The settings a multi-node GPU job needs (offline tokenizer, NCCL and allocator
variables, fp32 gradient reduction, timeouts, manual GC, checkpoint-and-exit on SIGUSR1 and
the requeue of slurm_pretrain.sbatch, no attention mask in the samples, a shared data cache)
are checked in the printed commands. The MoE recipes' router, expert-parallel layout (expert
TP 1, which Canzona requires) and uneven pipeline split are checked in the validated flags.
The tiny recipe also trains for a few iterations with each Muon variant, and saves a
checkpoint and exits on SIGUSR1.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = ROOT / "examples" / "qwen3"

RECIPES = {
    "qwen3-1.7b": "pretrain_qwen3_1.7b.sh",
    "qwen3-4b": "pretrain_qwen3_4b.sh",
    "qwen3-8b": "pretrain_qwen3_8b.sh",
    "qwen3-14b": "pretrain_qwen3_14b.sh",
    "qwen3-32b": "pretrain_qwen3_32b.sh",
    "qwen3-30b-a3b": "pretrain_qwen3_30b_a3b.sh",
    "qwen3-235b-a22b": "pretrain_qwen3_235b_a22b.sh",
    "qwen3-tiny": "pretrain_qwen3_tiny.sh",
    "qwen3-moe-tiny": "pretrain_qwen3_moe_tiny.sh",
}
LONG_CONTEXT = {"qwen3-8b-32k": ("qwen3-8b", "pretrain_qwen3_8b_32k.sh")}
"""Recipes of a catalog model at a longer context (name -> model, recipe): context parallelism."""
FSDP_RECIPES = {"qwen3-8b-fsdp": ("qwen3-8b", "pretrain_qwen3_8b_fsdp.sh")}
"""Recipes under Megatron-FSDP (name -> model, recipe); their variants are FSDP_VARIANTS."""
FSDP_VARIANTS = ("canzona", "sync", "adamw")
CPU_RECIPES = ("qwen3-tiny", "qwen3-moe-tiny")
GPU_RECIPES = [model for model in RECIPES if model not in CPU_RECIPES]
VARIANTS = ("canzona", "sync", "layerwise", "adamw")


@dataclass(frozen=True)
class MoE:
    """What a MoE recipe declares beyond the catalog: its layout and token dispatcher."""

    ep_size: int
    pp_first_last: tuple[int, int] | None = None
    dispatcher: str = "alltoall"
    grouped_gemm: bool = True


MOE_RECIPES = {
    "qwen3-30b-a3b": MoE(ep_size=8),
    "qwen3-235b-a22b": MoE(ep_size=8, pp_first_last=(11, 11)),
    # All-gather dispatch and one GEMM per expert: what runs on CPU (the recipe says why).
    "qwen3-moe-tiny": MoE(ep_size=2, dispatcher="alltoall", grouped_gemm=False),
}

# Entries of Qwen3's tokenizer (151,643 BPE tokens + 26 special ones) and of the demo
# SentencePiece tokenizer; Megatron pads them to the embedding size of the catalog.
TOKENIZER_VOCAB = {"qwen3-tiny": 1024, "qwen3-moe-tiny": 1024}
QWEN3_TOKENIZER_VOCAB = 151669
# One node and eight nodes of 8 GPUs. 235B-A22B runs on multiples of 64 GPUs (EP 8 x PP 8 for
# the experts, TP 4 x PP 8 for the rest): 16 and 32 nodes, DP 4 and 8, expert-DP 2 and 4 (at
# 8 nodes one GPU would hold its experts' whole optimizer state). The tiny recipes run 2 CPU
# ranks.
WORLD_SIZES = {model: (8, 64) for model in GPU_RECIPES} | {"qwen3-235b-a22b": (128, 256)} \
    | {model: (2,) for model in CPU_RECIPES} | {name: (64, 256) for name in LONG_CONTEXT} \
    | {name: (64, 128) for name in FSDP_RECIPES}
CHECK_TIMEOUT_S = 240
TINY_RUN_TIMEOUT_S = 240


def dry_run(recipe: str, *args: str, **env: str) -> list[str]:
    """The recipe's torchrun command (DRY_RUN=1), split into words."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "MASTER_", "NNODES", "NODE_RANK", "VARIANT", "OPTIMIZER", "TP", "CP", "PP",
                                  "PRECISION", "EP", "ETP", "NCCL_", "GLOO_", "TORCH_NCCL_", "PYTORCH_CUDA_ALLOC_CONF", "DATA_",
                                  "TOKENIZER_", "DIST_TIMEOUT", "GC_INTERVAL", "SHUTDOWN_TIMEOUT"))}
    result = subprocess.run(["bash", str(RECIPES_DIR / recipe), *args], env={**clean, "DRY_RUN": "1", **env},
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    return shlex.split(lines[0])


def split_command(words: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun words up to pretrain_gpt.py inclusive, pretrain_gpt.py flags), without ``env VAR=...``."""
    assert words[0] == "env", words[:3]
    start = next(i for i, word in enumerate(words[1:], 1) if "=" not in word)
    index = next(i for i, word in enumerate(words) if word.endswith("pretrain_gpt.py"))
    return words[start: index + 1], words[index + 1:]


def launch_env(words: list[str]) -> dict[str, str]:
    """The ``VAR=value`` words of the ``env`` prefix."""
    return dict(word.split("=", 1) for word in words[1:next(i for i, w in enumerate(words[1:], 1) if "=" not in w)])


def flag_value(words: list[str], flag: str) -> str:
    """The value after the last occurrence of ``flag``."""
    index = len(words) - 1 - words[::-1].index(flag)
    return words[index + 1]


# --- the scripts themselves ------------------------------------------------------------------


def shell_scripts() -> list[Path]:
    return sorted([*RECIPES_DIR.glob("*.sh"), *RECIPES_DIR.glob("*.sbatch"), ROOT / "tools" / "slurm_local.sh"])


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda path: path.name)
def test_script_parses_with_bash_n(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def _shellcheck() -> str | None:
    """shellcheck's path; as root with apt-get (as CI), installed first when missing, as
    tools/slurm_local.sh installs SLURM."""
    if shutil.which("shellcheck") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

        def apt_get(*args: str) -> bool:
            return subprocess.run(["apt-get", *args], env=env, capture_output=True, timeout=300,
                                  check=False).returncode == 0

        install = ("install", "-y", "-q", "--no-install-recommends", "shellcheck")
        if not apt_get(*install) and apt_get("update", "-q"):
            apt_get(*install)
    return shutil.which("shellcheck")


@pytest.mark.timeout(700)
def test_scripts_pass_shellcheck() -> None:
    if _shellcheck() is None:
        pytest.skip("shellcheck is not installed and apt-get could not install it (not root, or offline)")
    ours = [*(RECIPES_DIR / name for name in RECIPES.values()),
            *(RECIPES_DIR / recipe for _, recipe in (*LONG_CONTEXT.values(), *FSDP_RECIPES.values())),
            RECIPES_DIR / "common.sh",
            RECIPES_DIR / "slurm_pretrain.sbatch", ROOT / "tools" / "slurm_local.sh"]
    result = subprocess.run(["shellcheck", "-x", *map(str, ours)], cwd=ROOT, capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# --- what the dry run prints -----------------------------------------------------------------


def test_single_node_uses_a_free_local_port() -> None:
    launcher, _ = split_command(dry_run(RECIPES["qwen3-8b"]))
    assert launcher[1:3] == ["-m", "torch.distributed.run"]
    assert "--standalone" in launcher and flag_value(launcher, "--nproc-per-node") == "8"


def test_tensor_parallel_runs_get_one_cuda_work_queue() -> None:
    """Megatron's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 for TP > 1 (before Blackwell)."""
    assert launch_env(dry_run(RECIPES["qwen3-8b"]))["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in launch_env(dry_run(RECIPES["qwen3-1.7b"]))
    assert launch_env(dry_run(RECIPES["qwen3-1.7b"], TP="2"))["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_slurm_environment_sets_the_rendezvous() -> None:
    """Inside an srun task: node count and rank from SLURM, master from the sbatch script."""
    words = dry_run(RECIPES["qwen3-32b"], SLURM_NNODES="4", SLURM_NODEID="2",
                    MASTER_ADDR="gpu-node-07", MASTER_PORT="23456")
    launcher, _ = split_command(words)
    assert "--standalone" not in launcher
    assert [flag_value(launcher, flag) for flag in ("--nnodes", "--node-rank", "--master-addr", "--master-port")] \
        == ["4", "2", "gpu-node-07", "23456"]


FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] && printf 'gpu-a17\\ngpu-a18\\ngpu-b02\\n'
"""
# srun as SLURM would run it: the command once per node, with that node's SLURM_NODEID.
FAKE_SRUN = """#!/usr/bin/env bash
echo "srun $*" >&2
while [[ "$1" == -* ]]; do shift; done
for (( node = 0; node < SLURM_NNODES; node++ )); do SLURM_NODEID=$node "$@" || exit; done
"""


def test_sbatch_starts_one_torchrun_per_node_with_slurm_rendezvous(tmp_path: Path) -> None:
    """slurm_pretrain.sbatch with stand-ins for scontrol and srun: one launch per node, ranks
    0..N-1, the first host as master, the port from the job id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "DRY_RUN": "1", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu-a[17-18],gpu-b02", "SLURM_NNODES": "3", "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_CPUS_ON_NODE": "96", "SLURM_GPUS_ON_NODE": "8"}
    result = subprocess.run(["bash", str(RECIPES_DIR / "slurm_pretrain.sbatch"), "examples/qwen3/pretrain_qwen3_14b.sh",
                             "--train-iters", "9"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--ntasks-per-node=1" in result.stderr and "--kill-on-bad-exit=1" in result.stderr
    assert "--cpus-per-task=96" in result.stderr
    launches = [shlex.split(line) for line in result.stdout.splitlines() if "torch.distributed.run" in line]
    assert len(launches) == 3, result.stdout
    for node_rank, words in enumerate(launches):
        launcher, flags = split_command(words)
        assert [flag_value(launcher, f) for f in ("--nnodes", "--node-rank", "--master-addr", "--master-port",
                                                  "--nproc-per-node")] == ["3", str(node_rank), "gpu-a17", "24242", "8"]
        assert flags[-2:] == ["--train-iters", "9"]


def test_sbatch_signal_is_the_one_the_ranks_checkpoint_on() -> None:
    """SLURM signals the batch script 180 s before the time limit with the signal Megatron's
    exit handler listens for (--exit-signal), and the job may requeue itself."""
    directives = [line.split()[1] for line in (RECIPES_DIR / "slurm_pretrain.sbatch").read_text().splitlines()
                  if line.startswith("#SBATCH")]
    assert "--requeue" in directives
    signal_directive = next(d for d in directives if d.startswith("--signal="))
    assert signal_directive == "--signal=B:USR1@180"
    _, flags = split_command(dry_run(RECIPES["qwen3-32b"]))
    assert "--exit-signal-handler" in flags and flag_value(flags, "--exit-signal") == "SIGUSR1"


# srun that runs until it gets a signal (or exits with SRUN_STATUS), logging what it got.
WAITING_SRUN = """#!/usr/bin/env bash
trap 'echo "srun got USR1" >> "$LOG"; exit 0' USR1
echo "srun $*" >> "$LOG"
[[ -n "${SRUN_STATUS:-}" ]] && exit "$SRUN_STATUS"
touch "$LOG.ready"
while :; do sleep 0.05; done
"""
LOGGING_SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$LOG"
[[ "$1 $2" == "show hostnames" ]] && echo gpu-a17
exit 0
"""


def run_sbatch_script(tmp_path: Path, send_usr1: bool, **env: str) -> tuple[int, str]:
    """slurm_pretrain.sbatch with stand-ins for srun and scontrol: its exit status and their log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", LOGGING_SCONTROL), ("srun", WAITING_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log), "SLURM_JOB_ID": "4242",
                "SLURM_JOB_NODELIST": "gpu-a17", "SLURM_NNODES": "1", "SLURM_SUBMIT_DIR": str(ROOT), **env}
    process = subprocess.Popen(["bash", str(RECIPES_DIR / "slurm_pretrain.sbatch"), "examples/qwen3/pretrain_qwen3_8b.sh"],
                               cwd=tmp_path, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if send_usr1:
        ready = Path(f"{log}.ready")
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        process.send_signal(signal.SIGUSR1)
    output, _ = process.communicate(timeout=30)
    return process.returncode, log.read_text() + output


def test_usr1_to_the_batch_script_reaches_srun_then_requeues(tmp_path: Path) -> None:
    code, calls = run_sbatch_script(tmp_path, send_usr1=True)
    assert code == 0, calls
    assert "srun got USR1" in calls and "scontrol requeue 4242" in calls, calls


def test_a_failed_step_is_not_requeued(tmp_path: Path) -> None:
    code, calls = run_sbatch_script(tmp_path, send_usr1=False, SRUN_STATUS="3")
    assert code == 3, calls
    assert "scontrol requeue" not in calls, calls


def test_several_nodes_without_master_is_an_error() -> None:
    result = subprocess.run(["bash", str(RECIPES_DIR / RECIPES["qwen3-8b"])], capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], "DRY_RUN": "1", "NNODES": "2"}, check=False)
    assert result.returncode == 2 and "MASTER_ADDR" in result.stderr, result.stderr


def test_unknown_variant_is_an_error() -> None:
    result = subprocess.run(["bash", str(RECIPES_DIR / RECIPES["qwen3-8b"])], capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], "DRY_RUN": "1", "VARIANT": "zero3"}, check=False)
    assert result.returncode == 2 and "VARIANT=zero3" in result.stderr, result.stderr


def test_variants_select_the_compared_optimizers() -> None:
    flags = {variant: split_command(dry_run(RECIPES["qwen3-8b"], VARIANT=variant))[1] for variant in VARIANTS}
    assert "--canzona" in flags["canzona"] and flag_value(flags["canzona"], "--canzona-tp-mode") == "async"
    assert "--canzona" in flags["sync"] and flag_value(flags["sync"], "--canzona-tp-mode") == "sync"
    assert "--canzona" not in flags["layerwise"] and flag_value(flags["layerwise"], "--muon-tp-mode") == "duplicated"
    assert "--canzona" not in flags["adamw"] and flag_value(flags["adamw"], "--optimizer") == "adam"
    for variant in ("canzona", "sync", "layerwise"):
        assert flag_value(flags[variant], "--optimizer") == "muon"
    # Only the distribution differs: the training recipe is the same for all four.
    shared = ("--lr", "--min-lr", "--lr-warmup-iters", "--global-batch-size", "--seq-length", "--clip-grad")
    assert len({tuple(flag_value(f, name) for name in shared) for f in flags.values()}) == 1


def test_checkpoints_are_saved_and_loaded_in_one_directory() -> None:
    _, flags = split_command(dry_run(RECIPES["qwen3-14b"], CKPT_DIR="/shared/ckpt/14b"))
    assert flag_value(flags, "--save") == flag_value(flags, "--load") == "/shared/ckpt/14b"
    assert "--save-interval" in flags
    _, flags = split_command(dry_run(RECIPES["qwen3-14b"], CKPT_DIR="none"))
    assert "--save" not in flags and "--load" not in flags


def test_extra_arguments_come_last() -> None:
    _, flags = split_command(dry_run(RECIPES["qwen3-1.7b"], "--train-iters", "7"))
    assert flags[-2:] == ["--train-iters", "7"]


# --- what a multi-node GPU job needs ---------------------------------------------------------

# (recipe, environment): one 8-GPU node at TP 2, TP 8 and TP 4 x EP 8 x PP 8, and four nodes of the
# 32B recipe.
H100_CASES = {
    "8b": (RECIPES["qwen3-8b"], {}),
    "32b": (RECIPES["qwen3-32b"], {}),
    "32b-4-nodes": (RECIPES["qwen3-32b"], {"NNODES": "4", "NODE_RANK": "1", "MASTER_ADDR": "x"}),
    "235b-a22b": (RECIPES["qwen3-235b-a22b"], {}),
}
CLUSTER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
CLUSTER_FLAGS = ("--accumulate-allreduce-grads-in-fp32", "--manual-gc", "--exit-signal-handler",
                 "--no-create-attention-mask-in-dataloader")


@pytest.mark.parametrize("case", list(H100_CASES))
def test_h100_recipes_carry_every_cluster_setting(case: str) -> None:
    recipe, env = H100_CASES[case]
    words = dry_run(recipe, **env)
    launcher, flags = split_command(words)
    assert CLUSTER_ENV.items() <= launch_env(words).items()
    assert set(CLUSTER_FLAGS) <= set(flags)
    assert [flag_value(flags, f) for f in ("--distributed-timeout-minutes", "--manual-gc-interval", "--exit-signal")] \
        == ["30", "100", "SIGUSR1"]
    # torchrun relays SIGUSR1 (else the signal would end it) and waits for the saving ranks.
    assert "SIGUSR1" in flag_value(launcher, "--signals-to-handle").split(",")
    assert flag_value(launcher, "--shutdown-timeout") == "150"
    assert flag_value(flags, "--tokenizer-model") == str(ROOT / "data" / "tokenizers" / "Qwen3-8B")
    assert flag_value(flags, "--data-cache-path") == str(ROOT / "data" / "pretrain" / "cache")
    if env:
        assert [flag_value(launcher, f) for f in ("--nnodes", "--node-rank", "--master-addr")] == ["4", "1", "x"]


@pytest.mark.parametrize(("recipe", "env"), [
    (RECIPES["qwen3-32b"], {"NNODES": "4", "MASTER_ADDR": "x"}),  # DP 4
    (RECIPES["qwen3-8b"], {}),  # DP 4
    (RECIPES["qwen3-1.7b"], {"NNODES": "8", "MASTER_ADDR": "x"}),  # DP 64
], ids=["32b-dp4", "8b-dp4", "1.7b-dp64"])
def test_bf16_gradients_are_reduced_in_fp32_at_every_dp_size(recipe: str, env: dict[str, str]) -> None:
    """The rule of common.sh: always with bf16, so the numerics do not change with the node count."""
    _, flags = split_command(dry_run(recipe, **env))
    assert "--bf16" in flags and "--accumulate-allreduce-grads-in-fp32" in flags
    _, flags = split_command(dry_run(recipe, PRECISION="fp32", **env))
    assert "--bf16" not in flags and "--accumulate-allreduce-grads-in-fp32" not in flags


def test_an_older_torchrun_gets_no_shutdown_timeout(tmp_path: Path) -> None:
    """torch 2.11's torchrun refuses --shutdown-timeout (seen on a GPU machine): the recipe
    leaves it out there, and says what that costs."""
    run = tmp_path / "torch" / "distributed" / "run.py"
    run.parent.mkdir(parents=True)
    (tmp_path / "torch" / "__init__.py").write_text("")
    run.write_text("# a torchrun without the flag\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SHUTDOWN_TIMEOUT"))}
    result = subprocess.run(["bash", str(RECIPES_DIR / RECIPES["qwen3-8b"])], env={**env, "DRY_RUN": "1", "PYTHONPATH": str(tmp_path)},
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    launcher, _ = split_command(shlex.split(result.stdout))
    assert "--shutdown-timeout" not in launcher and "--signals-to-handle" in launcher
    assert "no --shutdown-timeout" in result.stderr


def test_network_variables_are_passed_on_when_set() -> None:
    network = {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "GLOO_SOCKET_IFNAME": "eth0"}
    words = dry_run(RECIPES["qwen3-32b"], NNODES="4", MASTER_ADDR="x", **network)
    assert network.items() <= launch_env(words).items()
    env = launch_env(dry_run(RECIPES["qwen3-32b"], NNODES="4", MASTER_ADDR="x"))
    assert not [name for name in env if name.startswith(("NCCL_", "GLOO_"))], env


def test_cluster_settings_follow_the_environment() -> None:
    words = dry_run(RECIPES["qwen3-14b"], DATA_PATH="/lustre/corpus/web_text_document", DIST_TIMEOUT_MINUTES="45",
                    GC_INTERVAL="20", SHUTDOWN_TIMEOUT="570", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False")
    launcher, flags = split_command(words)
    assert flag_value(flags, "--data-cache-path") == "/lustre/corpus/cache"
    assert [flag_value(flags, f) for f in ("--distributed-timeout-minutes", "--manual-gc-interval")] == ["45", "20"]
    assert flag_value(launcher, "--shutdown-timeout") == "570"
    assert launch_env(words)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    _, flags = split_command(dry_run(RECIPES["qwen3-14b"], DATA_CACHE="/shared/cache/14b"))
    assert flag_value(flags, "--data-cache-path") == "/shared/cache/14b"


def launch_checks(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The 8B recipe for real up to its launch, with an interpreter that reads the catalog
    (``python -c``) but launches nothing (exits 0 in place of torchrun): exit status 0 once
    the dataset and tokenizer checks pass."""
    prefix = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).touch()
    python = tmp_path / "python"
    python.write_text(f'#!/usr/bin/env bash\n[[ "$1" == -c ]] && exec {shlex.quote(sys.executable)} "$@"\nexit 0\n')
    python.chmod(0o755)
    full_env = {"PATH": os.environ["PATH"], "PYTHON": str(python), "DATA_PATH": str(prefix),
                "LOG_DIR": str(tmp_path / "log"), **env}
    return subprocess.run(["bash", str(RECIPES_DIR / RECIPES["qwen3-8b"])], env=full_env, capture_output=True,
                          text=True, timeout=30, check=False)


@pytest.mark.parametrize("tokenizer", ["missing", "Qwen/Qwen3-8B"])
def test_a_tokenizer_not_on_disk_is_an_error_naming_the_download(tmp_path: Path, tokenizer: str) -> None:
    """The ranks run offline, so a hub name or a missing directory stops the recipe before
    torchrun; DRY_RUN=1 prints the command without looking."""
    path = str(tmp_path / tokenizer) if tokenizer == "missing" else tokenizer
    result = launch_checks(tmp_path, TOKENIZER_MODEL=path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"TOKENIZER_MODEL={path}" in result.stderr
    assert f"huggingface-cli download Qwen/Qwen3-8B config.json tokenizer.json tokenizer_config.json vocab.json " \
           f"merges.txt --local-dir {path}" in result.stderr, result.stderr
    assert launch_checks(tmp_path, TOKENIZER_MODEL=path, DRY_RUN="1").returncode == 0


def test_a_local_tokenizer_directory_passes_the_checks(tmp_path: Path) -> None:
    tokenizer = tmp_path / "Qwen3-8B"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text("{}")
    result = launch_checks(tmp_path, TOKENIZER_MODEL=str(tokenizer))
    assert result.returncode == 0, result.stderr
    assert "[qwen3-8b] variant canzona" in result.stdout


# --- the tiny recipe for real --------------------------------------------------------------


def _run_tiny(recipe: str, demo_data, log_dir: Path, *args: str, **env: str) -> list[dict]:
    """One run of a CPU recipe on the demo data; its metrics lines."""
    from .support import run_with_deadline

    env = {"DATA_PATH": demo_data.data_prefix, "TOKENIZER_MODEL": str(demo_data.tokenizer_model), "SPLIT": "80,10,10",
           "LOG_DIR": str(log_dir), "CKPT_DIR": "none", "TRAIN_ITERS": "4", "WARMUP_ITERS": "1", "LOG_INTERVAL": "1",
           "EVAL_INTERVAL": "1000", **env}
    result = run_with_deadline(["bash", str(RECIPES_DIR / RECIPES[recipe]), *args], timeout_s=TINY_RUN_TIMEOUT_S,
                               env=env)
    assert result.returncode == 0, result.stdout[-6000:]
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["canzona", "layerwise"])
def test_tiny_recipe_trains_with_the_variant(demo_data, tmp_path: Path, variant: str) -> None:
    """Four iterations of pretrain_qwen3_tiny.sh on 2 gloo ranks (AdamW runs in test_failures.py
    and under SLURM in tests/slurm; --canzona-tp-mode sync in tests/multirank)."""
    metrics = _run_tiny("qwen3-tiny", demo_data, tmp_path, VARIANT=variant)
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    assert all(0 < m["lm_loss"] < 10 for m in metrics), metrics
    assert all(m["canzona"] == (variant != "layerwise") for m in metrics)


@pytest.mark.slow
@pytest.mark.quick
def test_moe_recipe_trains_at_ep2_and_resumes_at_ep1(demo_data, tmp_path: Path) -> None:
    """pretrain_qwen3_moe_tiny.sh with --canzona: 2 iterations at EP 2 (all-to-all dispatch,
    experts planned over expert-DP 1), a checkpoint, then EP 1 (experts dense parameters,
    planned over DP 2) resumes it through megatron.training's own load and trains on."""
    ckpt = tmp_path / "checkpoints"
    first = _run_tiny("qwen3-moe-tiny", demo_data, tmp_path / "ep2", "--exit-interval", "2",
                      CKPT_DIR=str(ckpt), SAVE_INTERVAL="2")
    assert [m["iteration"] for m in first] == [1, 2]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    second = _run_tiny("qwen3-moe-tiny", demo_data, tmp_path / "ep1", CKPT_DIR=str(ckpt), SAVE_INTERVAL="100", EP="1")
    assert [m["iteration"] for m in second] == [3, 4]
    assert all(m["canzona"] and 0 < m["lm_loss"] < 10 for m in first + second), first + second


def test_samples_come_without_attention_mask_when_asked(demo_data, tmp_path: Path) -> None:
    """What --no-create-attention-mask-in-dataloader asks of pretrain_gpt.py's datasets."""
    from megatron.canzona.data import GPTDataConfig, build_gpt_datasets, load_tokenizer

    tokenizer = load_tokenizer(demo_data.tokenizer_model)
    for create in (True, False):
        config = GPTDataConfig(data_prefix=demo_data.data_prefix, seq_length=64, split="80,10,10",
                               cache_dir=str(tmp_path), create_attention_mask=create)
        train, _, _ = build_gpt_datasets(config, tokenizer, (4, 1, 1))
        assert ("attention_mask" in train[0]) == create


@pytest.mark.slow
@pytest.mark.alone
def test_tiny_recipe_saves_and_exits_on_sigusr1(demo_data, tmp_path: Path) -> None:
    """SIGUSR1 to torchrun (the recipe exec's it), as srun relays it from slurm_pretrain.sbatch:
    both ranks finish their iteration, save it and exit 0; torchrun reports the signal."""
    ckpt_dir = tmp_path / "checkpoints"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "VARIANT": "adamw",
           "DATA_PATH": demo_data.data_prefix, "TOKENIZER_MODEL": str(demo_data.tokenizer_model), "SPLIT": "80,10,10",
           "LOG_DIR": str(tmp_path), "CKPT_DIR": str(ckpt_dir), "SAVE_INTERVAL": "100000", "TRAIN_ITERS": "100000",
           "WARMUP_ITERS": "1", "LOG_INTERVAL": "1", "EVAL_INTERVAL": "100000"}
    log = tmp_path / "out.log"
    with log.open("w") as out:
        process = subprocess.Popen(["bash", str(RECIPES_DIR / RECIPES["qwen3-tiny"])], cwd=ROOT, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + TINY_RUN_TIMEOUT_S
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.5)
        process.send_signal(signal.SIGUSR1)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = log.read_text()
    saved = int((ckpt_dir / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 2 and f"successfully saved checkpoint from iteration {saved:7d}" in output, output[-6000:]
    assert "exiting program after receiving SIGTERM" in output  # Megatron's words, whatever the signal
    assert "got signal: 10" in output and "exitcode" not in output, output[-6000:]  # no rank failed


# --- the flags through pretrain_gpt.py's parser and validation --------------------------------


@pytest.fixture(scope="module")
def validated(demo_data) -> dict[str, dict]:
    """``"<model>/<variant>/<world size>"`` -> the validated arguments (or the error). The CPU
    recipes read the demo tokenizer, which the parse checks look for on disk: the session's."""
    cases = []
    recipes = {**RECIPES, **{name: recipe for name, (_, recipe) in (*LONG_CONTEXT.items(), *FSDP_RECIPES.items())}}
    for model, recipe in recipes.items():
        local = {"TOKENIZER_MODEL": str(demo_data.tokenizer_model)} if model in CPU_RECIPES else {}
        for variant in FSDP_VARIANTS if model in FSDP_RECIPES else VARIANTS:
            words = dry_run(recipe, VARIANT=variant, **local)
            _, flags = split_command(words)
            for world_size in WORLD_SIZES[model]:
                cases.append({"name": f"{model}/{variant}/{world_size}", "flags": flags, "world_size": world_size,
                              "env": launch_env(words),
                              "tokenizer_vocab": TOKENIZER_VOCAB.get(model, QWEN3_TOKENIZER_VOCAB)})
    result = subprocess.run([sys.executable, __file__], input=json.dumps(cases), cwd=ROOT, capture_output=True,
                            text=True, timeout=CHECK_TIMEOUT_S, check=False,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _cases(models: list[str] | dict) -> list[str]:
    return [f"{m}/{v}/{w}" for m in models for v in VARIANTS for w in WORLD_SIZES[m]]


@pytest.mark.parametrize("case", _cases(RECIPES))
def test_flags_parse_and_validate(validated: dict[str, dict], case: str) -> None:
    args = validated[case]
    assert "error" not in args, f"{case}: {args.get('error')}"
    model, variant, world_size = case.split("/")
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    assert args["data_parallel_size"] * tp * pp == int(world_size)
    if variant in ("canzona", "sync"):
        assert args["canzona"] and args["use_distributed_optimizer"]
        assert args["canzona_tp_mode"] == ("sync" if variant == "sync" else "async")
    elif variant == "layerwise":
        assert not args["canzona"] and args["optimizer"] == "muon"
        assert args["use_layer_wise_distributed_optimizer"] and args["muon_tp_mode"] == "duplicated"
    else:
        assert not args["canzona"] and args["optimizer"] == "adam" and args["use_distributed_optimizer"]


@pytest.mark.parametrize("case", _cases(LONG_CONTEXT))
def test_long_context_recipe_cuts_each_sequence_over_cp_ranks(validated: dict[str, dict], case: str) -> None:
    """Qwen3-8B at 32K tokens: CP 4 x TP 2 per 8-GPU node, DP over the nodes, the 8B architecture."""
    from megatron.canzona.planning.qwen3 import get_qwen3_config

    args = validated[case]
    assert "error" not in args, f"{case}: {args.get('error')}"
    name, variant, world_size = case.split("/")
    tp, cp, pp = (args["tensor_model_parallel_size"], args["context_parallel_size"],
                  args["pipeline_model_parallel_size"])
    assert (tp, cp, pp, args["seq_length"], args["max_position_embeddings"]) == (2, 4, 1, 32768, 32768)
    assert args["data_parallel_size"] * tp * cp * pp == int(world_size) and args["global_batch_size"] == 32
    catalog = get_qwen3_config(LONG_CONTEXT[name][0])
    assert (args["num_layers"], args["hidden_size"], args["num_query_groups"]) == \
        (catalog.num_layers, catalog.hidden_size, catalog.num_query_groups)
    assert args["canzona"] == (variant in ("canzona", "sync"))


@pytest.mark.parametrize("case", [f"{m}/{v}/{w}" for m in FSDP_RECIPES for v in FSDP_VARIANTS for w in WORLD_SIZES[m]])
def test_fsdp_recipe_shards_over_every_gpu_with_megatron_fsdp(validated: dict[str, dict], case: str) -> None:
    """Qwen3-8B under Megatron-FSDP: optim_grads_params over all GPUs at TP 1, fsdp_dtensor
    checkpoints, gate and up hosted apart under --canzona (what the projection found fastest)."""
    args = validated[case]
    assert "error" not in args, f"{case}: {args.get('error')}"
    _, variant, world_size = case.split("/")
    assert args["use_megatron_fsdp"] and args["data_parallel_sharding_strategy"] == "optim_grads_params"
    assert args["ckpt_format"] == "fsdp_dtensor"
    assert (args["tensor_model_parallel_size"], args["data_parallel_size"]) == (1, int(world_size))
    assert args["canzona"] == (variant != "adamw")
    assert args["canzona_split_gate_up"] == (variant != "adamw")
    assert bool(args["canzona_narrow_gathers"]) == (variant == "canzona")  # the default (sync: none to gather)
    assert args["num_layers"] == 36 and args["global_batch_size"] == 128


def test_fsdp_recipe_refuses_the_layer_wise_variant() -> None:
    result = subprocess.run(["bash", str(RECIPES_DIR / FSDP_RECIPES["qwen3-8b-fsdp"][1])], capture_output=True,
                            text=True, timeout=30, env={**os.environ, "DRY_RUN": "1", "VARIANT": "layerwise"})
    assert result.returncode == 2 and "layer-wise Muon does not run under Megatron-FSDP" in result.stderr


@pytest.mark.parametrize("model", list(RECIPES))
def test_recipe_declares_the_catalog_architecture(validated: dict[str, dict], model: str) -> None:
    from megatron.canzona.planning.qwen3 import get_qwen3_config

    catalog = get_qwen3_config(model)
    moe = bool(getattr(catalog, "num_experts", None))
    assert moe == (model in MOE_RECIPES), model
    for case in _cases([model]):
        args = validated[case]
        assert "error" not in args, f"{case}: {args.get('error')}"
        declared = {
            "num_layers": args["num_layers"], "hidden_size": args["hidden_size"],
            "ffn_hidden_size": args["ffn_hidden_size"], "num_attention_heads": args["num_attention_heads"],
            "num_query_groups": args["num_query_groups"], "kv_channels": args["kv_channels"],
            "vocab_size": args["padded_vocab_size"],
            "tied_embeddings": not args["untie_embeddings_and_output_weights"],
            "seq_length": args["seq_length"],
        }
        if moe:  # (ffn_hidden_size is then config.json's intermediate_size, which no layer uses)
            declared |= {"num_experts": args["num_experts"], "moe_ffn_hidden_size": args["moe_ffn_hidden_size"],
                         "moe_router_topk": args["moe_router_topk"]}
        else:
            assert args["num_experts"] is None, case
        expected = {name: getattr(catalog, name) for name in declared}
        assert declared == expected, case
        # What every Qwen3 shares (reference notes §6).
        assert args["group_query_attention"] and args["qk_layernorm"] and args["swiglu"]
        assert args["normalization"] == "RMSNorm" and args["layernorm_epsilon"] == 1e-6
        assert args["position_embedding_type"] == "rope" and args["rotary_base"] == 1_000_000
        assert not args["add_bias_linear"]


@pytest.mark.parametrize("model", GPU_RECIPES)
def test_gpu_recipes_use_the_paper_training_settings(validated: dict[str, dict], model: str) -> None:
    args = validated[f"{model}/canzona/{WORLD_SIZES[model][-1]}"]
    assert (args["lr"], args["min_lr"], args["lr_warmup_iters"], args["lr_decay_style"]) == (4e-4, 4e-5, 50, "cosine")
    assert (args["global_batch_size"], args["clip_grad"], args["weight_decay"]) == (128, 1.0, 0.1)
    assert args["bf16"] and args["seq_length"] in (2048, 4096)
    # Tensor parallelism stays inside one 8-GPU node; sequence parallelism comes with it.
    assert 8 % args["tensor_model_parallel_size"] == 0
    assert args["sequence_parallel"] == (args["tensor_model_parallel_size"] > 1)
    assert (args["muon_momentum"], args["muon_scale_mode"], args["muon_extra_scale_factor"]) == (0.95, "spectral", 0.2)


@pytest.mark.parametrize("model", GPU_RECIPES)
def test_gpu_recipes_validate_with_the_cluster_settings(validated: dict[str, dict], model: str) -> None:
    for variant in VARIANTS:
        args = validated[f"{model}/{variant}/{WORLD_SIZES[model][-1]}"]
        assert args["accumulate_allreduce_grads_in_fp32"] and not args["create_attention_mask_in_dataloader"]
        assert args["exit_signal_handler"] and args["exit_signal"] == signal.SIGUSR1
        assert args["manual_gc"] and args["manual_gc_interval"] == 100
        assert args["distributed_timeout_minutes"] == 30


@pytest.mark.parametrize("model", list(MOE_RECIPES))
def test_moe_recipes_route_and_lay_out_experts_as_qwen3(validated: dict[str, dict], model: str) -> None:
    """Qwen3-MoE's router (softmax, normalised top-k: Megatron's top-k-then-softmax without
    --moe-router-pre-softmax; aux loss 1e-3), every layer MoE without a shared expert, and the
    recipe's expert layout: EP, expert TP 1 for every variant (the only size Canzona takes),
    the uneven pipeline split."""
    moe = MOE_RECIPES[model]
    # As launched (on CPU the child's adaptation may switch grouped GEMM off).
    _, flags = split_command(dry_run(RECIPES[model]))
    assert ("--moe-grouped-gemm" in flags) == moe.grouped_gemm and "--moe-router-pre-softmax" not in flags
    for case in _cases([model]):
        args = validated[case]
        assert "error" not in args, f"{case}: {args.get('error')}"
        assert args["moe_router_score_function"] == "softmax" and not args["moe_router_pre_softmax"], case
        assert args["moe_router_load_balancing_type"] == "aux_loss" and args["moe_aux_loss_coeff"] in (1e-3, [1e-3])
        assert args["moe_layer_freq"] == 1 and args["moe_shared_expert_intermediate_size"] is None, case
        assert args["moe_token_dispatcher_type"] == moe.dispatcher, case
        assert (args["expert_model_parallel_size"], args["expert_tensor_parallel_size"]) == (moe.ep_size, 1), case
        first_last = (args["decoder_first_pipeline_num_layers"], args["decoder_last_pipeline_num_layers"])
        assert first_last == (moe.pp_first_last or (None, None)), case
        pp = args["pipeline_model_parallel_size"]
        if moe.pp_first_last:  # the middle stages share the rest equally
            assert (args["num_layers"] - sum(moe.pp_first_last)) % (pp - 2) == 0, case
        world_size = int(case.split("/")[-1])
        assert world_size % (moe.ep_size * pp) == 0 and args["num_experts"] % moe.ep_size == 0, case


def test_moe_flags_only_in_moe_recipes() -> None:
    """The MoE flags come with NUM_EXPERTS: a dense recipe's command names none of them."""
    _, dense = split_command(dry_run(RECIPES["qwen3-32b"]))
    assert not [flag for flag in dense if flag.startswith(("--moe-", "--num-experts", "--expert-", "--decoder-first"))]
    _, flags = split_command(dry_run(RECIPES["qwen3-235b-a22b"], VARIANT="layerwise"))
    assert [flag_value(flags, f) for f in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                                           "--expert-model-parallel-size", "--expert-tensor-parallel-size")] \
        == ["11", "11", "8", "1"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_canzona_variants_refuse_expert_tensor_parallelism(variant: str) -> None:
    result = subprocess.run(["bash", str(RECIPES_DIR / RECIPES["qwen3-235b-a22b"])], capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], "DRY_RUN": "1", "VARIANT": variant, "ETP": "4"},
                            check=False)
    if variant in ("canzona", "sync"):
        assert result.returncode == 2 and "ETP=4" in result.stderr and "size 1 only" in result.stderr, result.stderr
    else:  # Megatron's own optimizers take expert TP
        assert result.returncode == 0, result.stderr
        assert flag_value(shlex.split(result.stdout), "--expert-tensor-parallel-size") == "4"


# --- the child: parse and validate every case in one process ----------------------------------

_REPORTED = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "group_query_attention", "qk_layernorm", "swiglu", "normalization", "layernorm_epsilon", "position_embedding_type",
    "rotary_base", "add_bias_linear", "untie_embeddings_and_output_weights", "seq_length",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "max_position_embeddings",
    "data_parallel_size", "sequence_parallel", "use_megatron_fsdp", "data_parallel_sharding_strategy",
    "canzona_split_gate_up", "canzona_narrow_gathers",
    "optimizer", "canzona", "canzona_tp_mode", "use_distributed_optimizer", "use_layer_wise_distributed_optimizer",
    "muon_tp_mode", "muon_momentum", "muon_scale_mode", "muon_extra_scale_factor",
    "lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "global_batch_size", "micro_batch_size", "clip_grad",
    "weight_decay", "bf16", "save", "load", "ckpt_format",
    "accumulate_allreduce_grads_in_fp32", "create_attention_mask_in_dataloader", "exit_signal_handler", "exit_signal",
    "manual_gc", "manual_gc_interval", "distributed_timeout_minutes",
    "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_layer_freq", "moe_shared_expert_intermediate_size",
    "moe_token_dispatcher_type", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
)


_LAUNCH_VARIABLES = ("CUDA_DEVICE_MAX_CONNECTIONS",)


def _validate_case(pretrain_gpt, adapt_args_to_cpu, case: dict) -> dict:
    """``pretrain_gpt.parse_and_validate`` on one flag list, without setting Megatron's globals.

    The environment is the one the recipe launches with: the CPU adaptation's own setting of
    CUDA_DEVICE_MAX_CONNECTIONS is undone, so validate_args checks what a GPU run would get.
    """
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    from canzona_patches.integration.arguments import narrow_gathers_of

    def launch_environment() -> None:
        for name in _LAUNCH_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(case["env"])

    def adapt_without_environment(args):
        notes = adapt_args_to_cpu(args)
        launch_environment()
        return notes

    pretrain_gpt.set_global_variables = lambda args, **_: None
    pretrain_gpt.adapt_args_to_cpu = adapt_without_environment
    sys.argv = ["pretrain_gpt.py", *case["flags"]]
    launch_environment()
    os.environ.update(WORLD_SIZE=str(case["world_size"]), RANK="0", LOCAL_RANK="0")
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            args = pretrain_gpt.parse_and_validate()
    except SystemExit as exit_:
        return {"error": f"exit {exit_.code}: {stderr.getvalue().strip()[-2000:]}"}
    except Exception as error:  # noqa: BLE001  (reported to the test as the case's failure)
        return {"error": f"{type(error).__name__}: {error}"}
    report = {name: getattr(args, name, None) for name in _REPORTED}
    if args.canzona:  # as the run takes it (its default: under Megatron-FSDP wherever it applies)
        report["canzona_narrow_gathers"] = narrow_gathers_of(args)
    report["padded_vocab_size"] = vocab_size_with_padding(case["tokenizer_vocab"], args, logging_enabled=False)
    return report


def _main() -> None:
    cases = json.loads(sys.stdin.read())
    sys.path.insert(0, str(ROOT))
    import torch

    if not torch.cuda.is_available():
        # validate_args asks the device whether it has --moe-grouped-gemm's kernels (compute
        # capability 8 or more): answer as the H100 the GPU recipes are written for.
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
    with contextlib.redirect_stdout(io.StringIO()):
        import pretrain_gpt
    adapt_args_to_cpu = pretrain_gpt.adapt_args_to_cpu
    results = {case["name"]: _validate_case(pretrain_gpt, adapt_args_to_cpu, case) for case in cases}
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
