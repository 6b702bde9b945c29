"""Where a measurement was taken: the repository's revision and the machine, for the JSON
that benchmarks and tools write beside their numbers; and waiting for a quiet machine first."""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository (``megatron/canzona/`` is two levels below it)."""


def git_revision(root: str = ROOT) -> str | None:
    """HEAD's commit, read from ``.git`` (no git process); ``None`` outside a checkout."""

    def read(*parts: str) -> str:
        with open(os.path.join(*parts)) as stream:
            return stream.read().strip()

    git = os.path.join(root, ".git")
    try:
        if os.path.isfile(git):  # a worktree: "gitdir: PATH"
            git = read(git).split(":", 1)[1].strip()
        head = read(git, "HEAD")
        if not head.startswith("ref: "):
            return head
        ref = head.removeprefix("ref: ")
        if os.path.exists(os.path.join(git, ref)):
            return read(git, ref)
        common = os.path.join(git, read(git, "commondir")) if os.path.exists(os.path.join(git, "commondir")) else git
        if os.path.exists(os.path.join(common, ref)):
            return read(common, ref)
        packed = read(common, "packed-refs").splitlines()
        return next((line.split()[0] for line in packed if line.endswith(" " + ref)), None)
    except (OSError, IndexError):
        return None


def machine(device: Any = None) -> dict[str, Any]:
    """The platform, CPUs, Python and torch, the load average (how busy a shared machine
    was) and, for a CUDA ``device``, the GPU's name."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device is not None:
        info["device"] = str(device)
        if torch.device(device).type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(device)
    return info


def wait_for_quiet(max_load: float, max_wait_s: float, poll_s: float = 60.0) -> list[float]:
    """Sleep until the 1-minute load average is below ``max_load`` or ``max_wait_s`` passed;
    the loads seen, first to last (the caller reports them)."""
    seen = [os.getloadavg()[0]]
    deadline = time.monotonic() + max_wait_s
    while seen[-1] > max_load and time.monotonic() < deadline:
        print(f"load average {seen[-1]:.2f} > {max_load}: waiting {poll_s:.0f} s for other jobs", file=sys.stderr,
              flush=True)
        time.sleep(poll_s)
        seen.append(os.getloadavg()[0])
    return seen
