"""One training iteration under ``torch.profiler``, summed by owner (``--canzona-profile-iteration``).

Where an iteration's time goes outside the optimizer step is what separates two optimizers
whose steps cost the same. The profiled iteration answers it for any run of
``pretrain_gpt.py`` (Canzona's, Megatron's layer-wise Muon, AdamW):

* **by owner**: every CPU event's own time (Python frames included: the profiler records the
  stack) and every kernel's GPU time go to the innermost frame of a known owner -- Canzona's
  hooks (``canzona_patches/``, ``megatron/canzona/``), Megatron's DDP
  (``megatron/core/distributed/``), Megatron's timers -- else to the model inside
  forward-backward, to the optimizer inside ``optimizer.step()``, and to "other" (zeroing the
  buffers, the schedule's bookkeeping) around them;
* **host synchronisations** by owner: the CUDA runtime's synchronising calls (stream, event and
  device synchronise, blocking copies);
* **the GPU's idle time inside forward-backward**: the span of forward-backward less the time
  of the kernels launched in it (one stream: they do not overlap; the device's synchronisation
  spans, which the profiler also puts on the device's timeline, are not work).

The profiled iteration synchronises the device before and after forward-backward and the step
(so the phases do not overlap in the summary) and records Python stacks: it is slower than its
neighbours and is not a timing sample. One JSON object is written to
``--canzona-profile-file`` by the last rank, and one table printed.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

FORWARD_BACKWARD = "canzona.profile.forward_backward"
OPTIMIZER_STEP = "canzona.profile.optimizer_step"
PHASES = {FORWARD_BACKWARD: "forward_backward", OPTIMIZER_STEP: "optimizer_step"}

PROFILER = "profiler"
"""The profile's own work (its synchronisations): left out of every owner."""
SEE_THROUGH = "see through"
"""Frames that are no one's work: wrappers around every variant's calls (this module's phase
marks, the step timer) and CPU mode's redirects of Megatron's CUDA calls."""
FRAME_OWNERS = tuple((re.compile(pattern), who) for pattern, who in (
    (r"integration/profile\.py\(\d+\): _synchronize$", PROFILER),
    (r"integration/profile\.py|integration/training\.py\(\d+\): timed_step$"
     r"|integration/megatron_fixes\.py\(\d+\): train_step_numbered$|canzona_patches/emulation/", SEE_THROUGH),
    (r"megatron/core/timers\.py", "Megatron timers"),
    (r"megatron/core/(transformer|models|tensor_parallel|fusions)/|torch/nn/modules/"
     r"|pretrain_gpt\.py\(\d+\): (forward_step|loss_func|get_batch)$", "model"),
    (r"canzona_patches/|megatron/canzona/", "Canzona hooks"),
    (r"megatron/core/distributed/", "Megatron DDP"),
    (r"megatron/core/optimizer/|torch/optim/|emerging_optimizers/", "optimizer"),
))
"""Frame (``path(line): function``) pattern -> owner; an event belongs to its innermost frame
that has one (first match per frame), else to its phase's (:data:`PHASE_OWNERS`). Inside the
step, everything but the profiler's and the timers' work is the optimizer's."""
PHASE_OWNERS = {"forward_backward": "model", "optimizer_step": "optimizer", None: "other"}
"""The owner of an event no owned frame claims, by the phase it runs in."""
OWNERS = ("model", "Megatron DDP", "Canzona hooks", "optimizer", "Megatron timers", "other")
TOP_FRAMES = 8
"""Frames listed per owner in the summary (by CPU + GPU time)."""
TOP_OPS = 15
"""Operators outside the optimizer step listed in the summary (by GPU time, else CPU time):
name, calls, CPU ms, GPU ms."""
HOST_SYNCS = frozenset(("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"))
"""CUDA runtime calls that make the host wait for the device (a value read is a
``cudaMemcpyAsync`` and one of these; ``cudaMemcpy`` is the blocking copy)."""
STREAM_WAITS = frozenset(("cudaStreamWaitEvent",))
"""A stream waiting for another (a device-side wait, no host one): counted apart."""


def profiling_the_step(train_step: Callable[..., Any]) -> Callable[..., Any]:
    """``training.train_step`` that profiles iteration ``--canzona-profile-iteration`` (as the log
    numbers it: the first is 1)."""

    @functools.wraps(train_step)
    def train_step_profiled(*args: Any, iteration: int | None = None, **kwargs: Any) -> Any:
        from megatron.training import get_args

        options = get_args()
        wanted = getattr(options, "canzona_profile_iteration", None)
        if wanted is None or iteration is None or iteration + 1 != wanted:
            return train_step(*args, iteration=iteration, **kwargs)
        return profile_one_step(train_step, args, kwargs, iteration=iteration,
                                path=getattr(options, "canzona_profile_file", None))

    return train_step_profiled


def numbered_and_profiled(train_step: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """The ``train_step`` row: :func:`~canzona_patches.integration.megatron_fixes.numbering_the_step`
    inside :func:`profiling_the_step` (the registry replaces an attribute once)."""
    from canzona_patches.integration.megatron_fixes import numbering_the_step

    return profiling_the_step(numbering_the_step(train_step))


def profile_one_step(train_step: Callable[..., Any], args: tuple, kwargs: dict, *, iteration: int,
                     path: str | None) -> Any:
    """Run ``train_step(*args, **kwargs)`` under the profiler with its phases marked; write and
    print the summary."""
    args = list(args)
    optimizer, forward_backward = args[3], args[6]
    args[6] = _phase(forward_backward, FORWARD_BACKWARD)
    had_step = "step" in vars(optimizer)
    step = optimizer.step
    optimizer.step = _phase(step, OPTIMIZER_STEP)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with torch.profiler.profile(activities=activities, with_stack=True) as prof:
            result = train_step(*args, iteration=iteration, **kwargs)
            _synchronize()
    finally:
        if had_step:
            optimizer.step = step
        else:
            del optimizer.step
    summary = summarize(prof.events(), iteration=iteration, cuda=len(activities) > 1)
    if _is_last_rank():
        print(format_summary(summary), flush=True)
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(summary, indent=1) + "\n")
    return result


def _phase(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``function`` with the device idle before and after, inside one profiler range."""

    @functools.wraps(function)
    def marked(*args: Any, **kwargs: Any) -> Any:
        _synchronize()
        with torch.profiler.record_function(name):
            result = function(*args, **kwargs)
            _synchronize()
        return result

    return marked


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- the summary


def summarize(events: Iterable[Any], *, iteration: int, cuda: bool) -> dict[str, Any]:
    """The profile's CPU and GPU time, calls and host syncs by owner, phase spans and the GPU's
    idle time inside forward-backward (``None`` without CUDA)."""
    events = list(events)
    host = [e for e in events if _is_cpu(e)]
    spans = {PHASES[e.name]: (e.time_range.start, e.time_range.end) for e in host if e.name in PHASES}
    owner_of = _Owners(spans)
    owners = {name: {"cpu_ms": 0.0, "gpu_ms": 0.0, "host_syncs": 0, "stream_waits": 0} for name in OWNERS}
    frames: dict[tuple[str, str], list[float]] = {}
    ops: dict[str, list[float]] = {}
    for event in host:
        who, frame = owner_of(event)
        if who == PROFILER or event.name in PHASES:
            continue
        row = owners[who]
        cpu_ms = max(0.0, event.self_cpu_time_total) / 1e3
        gpu_ms = sum(kernel.duration for kernel in event.kernels) / 1e3
        row["cpu_ms"] += cpu_ms
        row["gpu_ms"] += gpu_ms
        times = frames.setdefault((who, frame), [0.0, 0.0])
        times[0] += cpu_ms
        times[1] += gpu_ms
        if who != "optimizer" and event.name.startswith(("aten::", "c10d::", "nccl:", "gloo:")):
            op = ops.setdefault(event.name, [0, 0.0, 0.0])
            op[0] += 1
            op[1] += cpu_ms
            op[2] += gpu_ms
        row["host_syncs"] += event.name in HOST_SYNCS
        row["stream_waits"] += event.name in STREAM_WAITS
    begin = min((e.time_range.start for e in host), default=0.0)
    end = max((e.time_range.end for e in host), default=0.0)
    phases_ms = {name: (b - a) / 1e3 for name, (a, b) in spans.items()}
    summary: dict[str, Any] = {
        "iteration": iteration,
        "device": "cuda" if cuda else "cpu",
        "wall_ms": (end - begin) / 1e3,
        "phases_ms": phases_ms,
        "owners": owners,
        "top_frames": {who: [[frame, round(cpu, 3), round(gpu, 3)] for (owner, frame), (cpu, gpu)
                             in sorted(frames.items(), key=lambda item: -sum(item[1])) if owner == who][:TOP_FRAMES]
                       for who in OWNERS},
        "top_ops_outside_step": [[name, count, round(cpu, 3), round(gpu, 3)] for name, (count, cpu, gpu)
                                 in sorted(ops.items(), key=lambda item: -(item[1][2] or item[1][1]))][:TOP_OPS],
        "gpu_idle_in_forward_backward_ms": None,
        "gpu_busy_in_forward_backward_ms": None,
    }
    if cuda and "forward_backward" in spans:
        a, b = spans["forward_backward"]
        busy = sum(kernel.duration for e in host if a <= e.time_range.start < b for kernel in e.kernels)
        summary["gpu_busy_in_forward_backward_ms"] = busy / 1e3
        summary["gpu_idle_in_forward_backward_ms"] = max(0.0, b - a - busy) / 1e3
    return summary


class _Owners:
    """Event -> owner: the innermost frame of a known owner, else the phase's (memoized by
    event, as siblings share their ancestors)."""

    def __init__(self, spans: dict[str, tuple[float, float]]) -> None:
        self.spans = spans
        self.by_frame: dict[int, tuple[str, str] | None] = {}

    def __call__(self, event: Any) -> tuple[str, str]:
        """(owner, the frame that decided it, or the phase's name)."""
        found = self._frame_owner(event)
        phase = self._phase(event)
        if found is None or (phase == "optimizer_step" and found[0] not in (PROFILER, "Megatron timers")):
            return PHASE_OWNERS[phase], phase or "outside the phases"
        return found

    def _frame_owner(self, event: Any) -> tuple[str, str] | None:
        chain = []
        found: tuple[str, str] | None = None
        node = event
        while node is not None:
            key = id(node)
            if key in self.by_frame:
                found = self.by_frame[key]
                break
            chain.append(key)
            # a Python frame's own event (torch records them with the stack), else the
            # operator's recorded stack, innermost frame first
            for frame in (node.name, *(getattr(node, "stack", None) or ())):
                who = next((who for pattern, who in FRAME_OWNERS if pattern.search(frame)), None)
                if who is not None and who != SEE_THROUGH:
                    found = (who, frame)
                    break
            if found is not None:
                break
            node = node.cpu_parent
        for key in chain:
            self.by_frame[key] = found
        return found

    def _phase(self, event: Any) -> str | None:
        start = event.time_range.start
        return next((name for name, (a, b) in self.spans.items() if a <= start < b), None)


def _is_cpu(event: Any) -> bool:
    return event.device_type == torch.autograd.DeviceType.CPU


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a table (one row per owner) and a line of phase times."""
    lines = [f" [canzona] profile of iteration {summary['iteration'] + 1} ({summary['device']}; synchronised "
             f"phases, Python stacks recorded: slower than an untimed iteration)",
             f"  {'owner':<16} {'CPU ms':>9} {'GPU ms':>9} {'host syncs':>11} {'stream waits':>13}"]
    for name, row in summary["owners"].items():
        lines.append(f"  {name:<16} {row['cpu_ms']:>9.2f} {row['gpu_ms']:>9.2f} {row['host_syncs']:>11d} "
                     f"{row['stream_waits']:>13d}")
    phases = ", ".join(f"{name} {ms:.1f} ms" for name, ms in summary["phases_ms"].items())
    line = f"  iteration {summary['wall_ms']:.1f} ms: {phases}"
    if summary["gpu_idle_in_forward_backward_ms"] is not None:
        line += f"; GPU idle inside forward-backward {summary['gpu_idle_in_forward_backward_ms']:.1f} ms"
    return "\n".join(lines + [line])


def _is_last_rank() -> bool:
    if not torch.distributed.is_initialized():
        return True
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
