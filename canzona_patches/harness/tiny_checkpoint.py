"""Save and resume the tiny GPT of ``tiny_gpt.py`` through Canzona's distributed checkpoints.

:func:`run_resume_jobs` is a rank body for :func:`megatron.canzona.runtime.launch`: each
:class:`ResumeJob` builds the tiny GPT at the launch's DP size, optionally loads the
tracked checkpoint of ``load_dir`` (model, optimizer state, step counters), trains steps
``[start, run.num_steps)`` on the same global batches an uninterrupted run sees at those
steps, optionally saves after step ``save_after`` and returns full parameters and losses.

The checkpoint holds the model's ``sharded_state_dict`` (Megatron's own format) and the
Canzona optimizer's (``canzona_patches.checkpoints.state``), written by ``save_distributed``:
staged, then committed atomically.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .tiny_gpt import TinyRun, build, full_params, model_parallel, train_step


@dataclass(frozen=True, kw_only=True)
class ResumeJob:
    """One training segment of a tiny-GPT run, with checkpoint I/O at its ends."""

    run: TinyRun
    """The whole run; ``run.num_steps`` is its last step (exclusive)."""
    load_dir: str | None = None
    """Resume from the checkpoint this directory's tracker names (its iteration = first step)."""
    save_dir: str | None = None
    """Where to save after each step listed in ``save_after``."""
    save_after: tuple[int, ...] = ()
    """Steps (1-based counts of completed steps) after which to save."""
    fault: str | None = None
    """A fault of ``canzona_patches/harness/faults.py`` armed for this job's saves (e.g. ``"write@4:1"``)."""
    verify_integrity: bool = False
    """Saves also write SHA-256 hashes of their files (``--verify-integrity``)."""
    expect_error: bool = False
    """Loading is expected to fail: return the error message instead of training."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form labels returned with the result."""


def run_resume_jobs(jobs: list[ResumeJob]) -> list[dict[str, Any]]:
    """Rank body: every job in order, each with fresh model-parallel state."""
    return [run_resume_job(job) for job in jobs]


def run_resume_job(job: ResumeJob) -> dict[str, Any]:
    """Rank body for one job; see the module docstring."""
    from canzona_patches.errors import CanzonaCheckpointError
    from canzona_patches.emulation.cpu import enable_cpu_mode

    enable_cpu_mode()  # Megatron's own Adam gets its baseline fixes when tiny_gpt builds it
    disarm = _arm(job.fault) if job.fault else lambda: None
    try:
        with model_parallel(job.run) as keep:
            model, ddp_model, optimizer, setup = build(job.run)
            plan = None if setup is None else setup.plan
            keep(ddp_model)
            start, load_s, in_place = 0, 0.0, []
            if job.load_dir is not None:
                began = time.perf_counter()
                try:
                    start = load_checkpoint(job.load_dir, model, optimizer, in_place)
                except CanzonaCheckpointError as error:
                    if job.expect_error:
                        return {"error": str(error), **job.extra}
                    raise
                load_s = time.perf_counter() - began
            if job.expect_error:
                return {"error": None, **job.extra}
            losses, save_s = [], []
            for step in range(start, job.run.num_steps):
                losses.append(train_step(job.run, ddp_model, optimizer, step)[0])
                if step + 1 in job.save_after:
                    began = time.perf_counter()
                    save_checkpoint(job.save_dir, step + 1, model, optimizer, verify_integrity=job.verify_integrity)
                    save_s.append(time.perf_counter() - began)
            return {
                "params": full_params(model), "losses": losses, "start": start, "load_seconds": load_s,
                "save_seconds": save_s, "loaded_in_place": in_place, "split_matrices": [] if plan is None else
                [p.name for layout in plan.layouts for p in layout.matrix.placements if p.host is None],
                **job.extra,
            }
    finally:
        disarm()


def _arm(fault: str):
    from .faults import arm

    return arm(fault)


def content_metadata(optimizer: Any) -> dict[str, Any]:
    """What ``megatron.training`` would declare: Canzona's format, or Megatron's default."""
    from canzona_patches.checkpoints.state import canzona_content_metadata, is_canzona_optimizer

    if is_canzona_optimizer(optimizer):
        return canzona_content_metadata()
    return {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}


def sharded_state_dict(model: torch.nn.Module, optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    """What a checkpoint of the tiny GPT holds: model weights and the optimizer state."""
    state = {"model": model.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=content_metadata(optimizer))
    return state


def save_checkpoint(save_dir: str, iteration: int, model: torch.nn.Module, optimizer: Any, *,
                    verify_integrity: bool = False) -> Path:
    """Save iteration ``iteration`` (atomically) into ``save_dir``."""
    from canzona_patches.checkpoints.state import save_distributed

    state = sharded_state_dict(model, optimizer, is_loading=False)
    return save_distributed(state, save_dir, iteration, content_metadata=content_metadata(optimizer),
                            verify_integrity=verify_integrity)


def load_checkpoint(load_dir: str, model: torch.nn.Module, optimizer: Any, in_place: list | None = None) -> int:
    """Load the tracked iteration of ``load_dir``; returns it (the next step to take). With
    ``in_place``, appends how many elements of the Canzona optimizer state the loader read
    straight into live tensors, and how many it loaded in all."""
    from canzona_patches.checkpoints.state import load_distributed, state_chunks
    from canzona_patches.checkpoints.files import enable_cpu_checkpointing

    enable_cpu_checkpointing()
    state, iteration = load_distributed(
        sharded_state_dict(model, optimizer, is_loading=True), load_dir, optimizer=optimizer
    )
    model.load_state_dict(state["model"])
    if in_place is not None and "state" in state["optimizer"]:
        live = {chunk.data.data_ptr() for chunk in state_chunks(optimizer, find_main=False)}
        loaded = [v for values in state["optimizer"]["state"].values() for v in (values if isinstance(values, list) else [values])]
        in_place.append((sum(v.numel() for v in loaded if v.data_ptr() in live), sum(v.numel() for v in loaded)))
    optimizer.load_state_dict(state["optimizer"])
    return iteration
