"""Hooks into ``megatron.training`` (megatron-core 0.19.2) for ``pretrain_gpt.py``.

Factories of the ``pretrain`` and ``canzona`` rows of :data:`canzona_patches.registry.PATCHES`
(which attribute each replaces, and when, is that table). Every hook replaces a module
attribute that ``megatron.training.training`` (or the dataset utilities) looks up by name at
call time:

* ``megatron.core.datasets.utils.compile_helpers`` (called by ``initialize._compile_
  dependencies``) -> ``megatron.canzona.data.ensure_dataset_helpers``: the registry wheel
  ships the prebuilt helpers but no Makefile, so ``make`` fails and initialization exits.
* ``training.setup_model_and_optimizer`` -> the same, then the returned optimizer's
  ``step`` is timed (:class:`IntervalMetrics`).
* ``training.training_log`` -> the same, then one more line per ``--log-interval`` (optimizer
  step time, tokens/s, progress) and, with ``--canzona-metrics-file``, one JSON line.
* ``megatron.training.arguments.parse_args`` -> the same with Canzona's flags added by
  default: ``pretrain`` re-parses the command line (``ft_integration.setup``) without an
  ``extra_args_provider``, and would reject ``--canzona`` or ``--optimizer shampoo``.
* Only with ``--canzona``: ``training.wrap_model_chunks_with_ddp`` makes the run's
  :class:`~canzona_patches.integration.setup.CanzonaSetup` (``setup_from_args``, on the chunks
  before DDP) and wraps each chunk in DDP with its layout; ``training.get_megatron_optimizer``
  (as ``setup_model_and_optimizer`` calls it) builds ``canzona_patches.integration.optimizer.
  build_canzona_optimizer`` on that same setup instead. The setup passes from the first hook
  to the second in a :class:`SetupHandoff` both share (:meth:`canzona_patches.registry.Run.shared`).

Checkpoint hooks are in :mod:`canzona_patches.checkpoints.state` and
:mod:`canzona_patches.checkpoints.files`, the CPU redirects in :mod:`canzona_patches.emulation.cpu`.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from canzona_patches.integration.arguments import add_canzona_args
from canzona_patches.integration.skipped import (
    SkippedLosses,
    interval_skipped_warning,
    nothing_trained_line,
    run_skipped_warning,
    skip_reason,
)
from canzona_patches.version import require_pinned_megatron

require_pinned_megatron()

import megatron.training.training as _training  # noqa: E402  (after the version check)
from megatron.core.num_microbatches_calculator import get_current_global_batch_size  # noqa: E402

LOSS_KEY = "lm loss"
"""The loss ``pretrain_gpt.py`` reports (Megatron-LM's name)."""


def with_canzona_flags(parse_args: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``parse_args`` whose parser knows Canzona's flags even when the caller adds none."""

    @functools.wraps(parse_args)
    def parse_args_with_canzona_flags(extra_args_provider=None, ignore_unknown_args=False):
        return parse_args(extra_args_provider=extra_args_provider or add_canzona_args,
                          ignore_unknown_args=ignore_unknown_args)

    return parse_args_with_canzona_flags


def shipped_dataset_helpers(compile_helpers: Callable[[], None], run: Any = None) -> Callable[[], None]:
    """Stand-in for ``compile_helpers``: the wheel's prebuilt helpers, compiled only if missing."""
    return _compile_helpers


def _compile_helpers() -> None:
    """Stand-in for ``megatron.core.datasets.utils.compile_helpers`` (no Makefile in the wheel)."""
    from megatron.canzona.data import ensure_dataset_helpers

    ensure_dataset_helpers()


# --- Canzona: layout before DDP, optimizer after ------------------------------------------


class SetupHandoff:
    """The setup made when the model was wrapped, for the optimizer built after it and for
    the logs (its plan's summary)."""

    def __init__(self) -> None:
        self.setup: Any = None

    def take(self) -> Any:
        if self.setup is None:
            raise RuntimeError("the Canzona optimizer is built before the model was wrapped in DDP with a Canzona "
                               "plan; --canzona needs megatron.training's setup_model_and_optimizer order")
        return self.setup

    @property
    def summary(self) -> dict | None:
        return None if self.setup is None else self.setup.summary


def _handoff(run: Any) -> SetupHandoff:
    """The run's one handoff, shared by the DDP hook and the optimizer hook."""
    return run.shared("setup handoff", SetupHandoff)


def with_canzona_layouts(wrap_model_chunks_with_ddp: Callable[..., Any], run: Any) -> Callable[..., Any]:
    """``wrap_model_chunks_with_ddp`` with the Canzona setup's ``FullParamLayout`` per chunk.

    Upstream computes ``DistributedOptimizer.compute_full_param_layout`` per chunk and wraps
    each chunk in ``DP(config=, ddp_config=, module=, disable_bucketing=,
    full_param_layout=)``; here the setup of every chunk together is made once
    (``setup_from_args``, which also tags the parameters) and handed over for the
    optimizer. Under ``--use-megatron-fsdp`` (``DP`` is ``megatron.core.distributed.
    FullyShardedDataParallel``) the setup plans over the buckets Megatron-FSDP will build, and
    upstream wraps the chunks as it would (``--use-torch-fsdp2`` is refused by the flag checks).
    """
    handoff = _handoff(run)

    @functools.wraps(wrap_model_chunks_with_ddp)
    def wrap_with_canzona_layouts(model_chunks, config, ddp_config, *, DP=_training.DDP,
                                  bucket_sizes=None, disable_bucketing_per_chunk=None,
                                  **kwargs: Any):
        from canzona_patches.integration.layout import gather_in_forward_order
        from canzona_patches.integration.setup import setup_from_args

        fsdp = DP is _training.megatron_FSDP
        if DP is not _training.DDP and not fsdp:
            raise RuntimeError("--canzona supports Megatron's DistributedDataParallel and Megatron-FSDP only")
        args = _training.get_args()
        handoff.setup = setup_from_args(model_chunks, ddp_config, args, summarize_here=_writes_logs(args))
        if fsdp:
            return wrap_model_chunks_with_ddp(model_chunks, config, ddp_config, DP=DP, bucket_sizes=bucket_sizes,
                                              disable_bucketing_per_chunk=disable_bucketing_per_chunk, **kwargs)
        disable = disable_bucketing_per_chunk or [False] * len(model_chunks)
        wrapped = [
            DP(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=off,
               full_param_layout=layout)
            for chunk, layout, off in zip(model_chunks, handoff.setup.layouts, disable)
        ]
        for ddp in wrapped:
            gather_in_forward_order(ddp)
        return wrapped

    return wrap_with_canzona_layouts


def canzona_optimizer(get_megatron_optimizer: Callable[..., Any], run: Any) -> Callable[..., Any]:
    """``get_megatron_optimizer(config, model_chunks, ...)`` -> Canzona's optimizer, on the setup
    the model was wrapped with."""
    handoff = _handoff(run)

    @functools.wraps(get_megatron_optimizer)
    def get_canzona_optimizer(config, model_chunks, *unused_args: Any, **unused: Any):
        # Megatron's per-parameter config_overrides (no weight decay on norms/biases, Adam
        # for embeddings under Muon) are the Canzona optimizer's own business.
        from canzona_patches.integration.optimizer import build_canzona_optimizer

        from canzona_patches.integration.qk_clip import attach_qk_clip

        optimizer = build_canzona_optimizer(config, model_chunks, handoff.take())
        attach_qk_clip(optimizer, model_chunks, run)
        return optimizer

    return get_canzona_optimizer


# --- Logging ------------------------------------------------------------------------------


EARLY_OUTCOMES = ("committed", "recomputed", "skipped", "not speculated")
"""The outcomes of a step of a run computing early, as the log line lists them."""


class IntervalMetrics:
    """What Megatron's ``training_log`` does not print, gathered over one log interval.

    Megatron resets its interval statistics at each log iteration except the first, which
    it prints without resetting; this follows the same rule so both lines cover the same
    iterations.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._path = Path(args.canzona_metrics_file) if args.canzona_metrics_file else None
        self._loss_sum: torch.Tensor | float = 0.0
        self._loss_count = 0
        self._skipped_loss_sum: torch.Tensor | float = 0.0  # lm_loss of an interval that trained nothing
        self._skipped_count = 0
        self._step_seconds = 0.0
        self._step_events: list[tuple[Any, Any]] = []
        self._iterations = 0
        self._samples = 0
        self._parts: list[Any] = []
        self._early_reported: collections.Counter[str] = collections.Counter()
        self._max_logit: torch.Tensor | None = None

    def watch(self, optimizer: Any) -> None:
        """Report the early compute of ``optimizer`` (each part of a chained one)."""
        self._parts = [p for p in getattr(optimizer, "chained_optimizers", [optimizer]) if hasattr(p, "early_steps")]

    def _early_steps(self) -> dict[str, int] | None:
        """Steps computed early since the last report, by outcome; ``None`` without early compute.
        The parts of a chained optimizer decide together: each outcome's most over them."""
        early = [p for p in self._parts if p.computes_early]
        if not early:
            return None
        return {k: max(p.early_steps[k] for p in early) - self._early_reported[k] for k in EARLY_OUTCOMES}

    def time_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap ``optimizer.step`` to accumulate its time without waiting for the device: on
        CUDA a pair of events per step, read at the next report; on CPU the wall time."""

        @functools.wraps(step)
        def timed_step(*args: Any, **kwargs: Any) -> Any:
            if _cuda_in_use():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    return step(*args, **kwargs)
                finally:
                    end.record()
                    self._step_events.append((start, end))
            begin = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self._step_seconds += time.perf_counter() - begin

        return timed_step

    def record(self, loss_dict: dict[str, torch.Tensor], skipped_iter: int,
               global_batch_size: int | None = None) -> None:
        """Account one iteration (``training_log`` is called once per iteration) of
        ``global_batch_size`` samples (default ``--global-batch-size``; smaller while
        ``--rampup-batch-size`` ramps up). The loss stays on its device, summed in float64,
        until a report reads it."""
        self._iterations += 1
        self._samples += global_batch_size or self._args.global_batch_size
        loss = loss_dict.get(LOSS_KEY)
        if loss is not None and not skipped_iter:
            self._loss_sum = self._loss_sum + loss.detach().float().sum().double()
            self._loss_count += 1
        elif loss is not None:
            self._skipped_loss_sum = self._skipped_loss_sum + loss.detach().float().sum().double()
            self._skipped_count += 1

    def record_max_logit(self, value: torch.Tensor | float | None) -> None:
        """Keep the interval's largest attention logit (``--qk-clip``/``--log-max-attention-logit``:
        what ``clip_qk`` returned, a 0-d tensor on the device, read at the report)."""
        if value is None or not (self._args.qk_clip or self._args.log_max_attention_logit):
            return
        value = torch.as_tensor(value, dtype=torch.float32)
        self._max_logit = value if self._max_logit is None else torch.maximum(self._max_logit, value)

    def _step_time(self) -> float:
        """Seconds in ``optimizer.step`` since the last reset (one device wait, for the events)."""
        if self._step_events:
            self._step_events[-1][1].synchronize()
            self._step_seconds += sum(start.elapsed_time(end) for start, end in self._step_events) / 1000.0
            self._step_events = []
        return self._step_seconds

    def report(self, *, iteration: int, interval_s: float, learning_rate: float | None,
               grad_norm: float | None, reset: bool) -> dict[str, Any]:
        """The interval's numbers; printed by the last rank, written as JSON if asked."""
        args = self._args
        iterations = max(1, self._iterations)
        step_s = _max_over_ranks(self._step_time()) / iterations
        tokens = self._samples * args.seq_length
        metrics = {
            "iteration": iteration,
            "train_iters": args.train_iters,
            "consumed_samples": args.consumed_train_samples,
            "lm_loss": (float(self._loss_sum) / self._loss_count if self._loss_count else
                        float(self._skipped_loss_sum) / self._skipped_count if self._skipped_count else None),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "learning_rate": learning_rate,
            "iteration_ms": 1000.0 * interval_s / iterations,
            "optimizer_step_ms": 1000.0 * step_s,
            "tokens_per_s": tokens / interval_s if interval_s > 0 else None,
            "progress": iteration / args.train_iters if args.train_iters else None,
            "optimizer": args.optimizer,
            "canzona": bool(args.canzona),
            "dp_size": args.data_parallel_size,
            "tp_size": args.tensor_model_parallel_size,
            "early_compute": self._early_steps(),
            "max_attention_logit": None if self._max_logit is None else _max_over_ranks(float(self._max_logit)),
        }
        if reset:
            self._max_logit = None
            self._early_reported.update(metrics["early_compute"] or {})
            self._loss_sum, self._loss_count, self._step_seconds, self._iterations, self._samples = 0.0, 0, 0.0, 0, 0
            self._skipped_loss_sum, self._skipped_count = 0.0, 0
        self._write(metrics)
        return metrics

    def _write(self, metrics: dict[str, Any]) -> None:
        if self._path is None or not _is_last_rank():
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        with self._path.open("a") as stream:
            stream.write(json.dumps(metrics) + "\n")


def _writes_logs(args: argparse.Namespace) -> bool:
    """Whether this rank holds Megatron's TensorBoard or W&B writer (the last rank, if asked)."""
    return bool(getattr(args, "tensorboard_dir", None) or getattr(args, "wandb_project", None)) and _is_last_rank()


def plan_scalars(summary: dict | None) -> dict[str, float]:
    """The plan's numbers logged beside Megatron's scalars (once per log interval)."""
    if not summary:
        return {}
    return {
        "canzona/plan makespan over lower bound": float(summary["makespan_over_lower_bound"]),
        "canzona/plan padding": float(summary["padding_overhead"]),
        "canzona/bytes sent per rank per step": float(summary["comm_bytes_per_rank"]),
    }


def write_scalars(metrics: dict[str, Any], plan: dict[str, float], iteration: int) -> None:
    """Canzona's scalars to Megatron's TensorBoard and W&B writers, where this rank has them."""
    scalars = {"canzona/optimizer step ms": metrics["optimizer_step_ms"], **plan}
    if metrics["tokens_per_s"] is not None:
        scalars["canzona/tokens per s"] = metrics["tokens_per_s"]
    for outcome, steps in (metrics["early_compute"] or {}).items():
        scalars[f"canzona/early compute {outcome} steps"] = steps
    writer = _training.get_tensorboard_writer()
    if writer is not None:
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, iteration)
    wandb_writer = _training.get_wandb_writer()
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)


def format_metrics(metrics: dict[str, Any]) -> str:
    """One Megatron-style line (`` name: value |`` fields) for :meth:`IntervalMetrics.report`."""
    line = " [canzona] iteration {:8d}/{:8d} |".format(metrics["iteration"], metrics["train_iters"] or 0)
    line += f" optimizer step (ms): {metrics['optimizer_step_ms']:.2f} |"
    if metrics["tokens_per_s"] is not None:
        line += f" throughput (tokens/s): {metrics['tokens_per_s']:.1f} |"
    early = metrics["early_compute"]
    if early is not None:
        line += f" early compute {'/'.join(EARLY_OUTCOMES)}: {'/'.join(str(early.get(k, 0)) for k in EARLY_OUTCOMES)} |"
    if metrics.get("max_attention_logit") is not None:
        line += f" max attention logit: {metrics['max_attention_logit']:.6g} |"
    if metrics["progress"] is not None:
        line += f" progress: {100.0 * metrics['progress']:.1f}% |"
    return line


def _metrics(run: Any) -> IntervalMetrics:
    """The run's one :class:`IntervalMetrics`, shared by the step timer and the log hook."""
    return run.shared("interval metrics", lambda: IntervalMetrics(run.args))


def timing_optimizer_step(setup_model_and_optimizer: Callable[..., Any], run: Any) -> Callable[..., Any]:
    """``setup_model_and_optimizer`` whose optimizer's ``step`` feeds the run's interval metrics."""
    metrics = _metrics(run)

    @functools.wraps(setup_model_and_optimizer)
    def setup_with_timed_step(*args: Any, **kwargs: Any):
        model, optimizer, scheduler = setup_model_and_optimizer(*args, **kwargs)
        if optimizer is not None:
            # An instance attribute shadows the class's step; train_step calls optimizer.step().
            optimizer.step = metrics.time_step(optimizer.step)
            metrics.watch(optimizer)
        return model, optimizer, scheduler

    return setup_with_timed_step


_ITERATIONS: collections.Counter[str] = collections.Counter()
"""This process's iterations of the job so far: ``trained`` and ``skipped``."""
_SKIPPED: collections.Counter[str] = collections.Counter()
"""This process's skipped iterations of the job so far, by :func:`skip_reason`."""
_LAST_NORM: list[float | None] = [None]
"""The gradient norm of the last skipped iteration (for the line that says why)."""


def iterations_this_job() -> tuple[int, int]:
    """``(trained, skipped)`` iterations this process has run (``training_log`` sees each)."""
    return _ITERATIONS["trained"], _ITERATIONS["skipped"]


def nothing_trained(args: Any, trained: int, skipped: int, reasons: collections.Counter | None = None) -> str | None:
    """Why a finished run trained nothing, when that was not asked for (``--skip-train``, or
    ``--train-iters`` equal to the iteration it loaded); ``None`` otherwise. ``reasons``: the
    skipped iterations by :func:`skip_reason` (default: this process's)."""
    if trained or getattr(args, "skip_train", False) or not getattr(args, "train_iters", None):
        return None
    if skipped:
        return nothing_trained_line(skipped, _SKIPPED if reasons is None else reasons, args, _LAST_NORM[0])
    loaded = getattr(args, "iteration", 0) or 0
    if loaded == args.train_iters:
        return None
    if loaded > args.train_iters:
        return (f"nothing trained: the checkpoint is at iteration {loaded}, past this run's --train-iters "
                f"{args.train_iters}; raise --train-iters above {loaded}")
    return f"nothing trained: the run ended at iteration {loaded} of --train-iters {args.train_iters}"


def logging_interval_metrics(training_log: Callable[..., Any], run: Any) -> Callable[..., Any]:
    """``training_log`` followed, at log iterations, by :func:`format_metrics`'s line.

    Megatron logs a run's first iteration even off the log interval and then keeps its sums
    (``is_first_iteration``), so that the next line covers the whole interval. When the first
    iteration *is* on the interval (a resume from a checkpoint saved on it, or any run with
    ``--log-interval 1``) those sums were kept all the same, and the next line averaged two
    intervals. Here the first iteration counts as first only off the interval, so a resumed
    run logs what the straight run logs, line for line."""
    metrics = _metrics(run)
    skipped_losses = SkippedLosses()
    interval_reasons: collections.Counter[str] = collections.Counter()

    @functools.wraps(training_log)
    def training_log_with_metrics(loss_dict, total_loss_dict, learning_rate, iteration,
                                  loss_scale, report_memory_flag, skipped_iter, grad_norm,
                                  *rest: Any, is_first_iteration: bool = False, **kwargs: Any):
        args = _training.get_args()
        metrics.record(loss_dict, skipped_iter, get_current_global_batch_size())
        metrics.record_max_logit(rest[2] if len(rest) > 2 else kwargs.get("max_attention_logit"))
        _ITERATIONS["skipped" if skipped_iter else "trained"] += 1
        if skipped_iter:
            reason = skip_reason(grad_norm, args)
            _SKIPPED[reason] += 1
            interval_reasons[reason] += 1
            _LAST_NORM[0] = None if grad_norm is None else float(grad_norm)
        skipped_losses.record(loss_dict, skipped_iter)
        interval_skipped = skipped_losses.all_skipped
        on_interval = iteration % args.log_interval == 0
        is_first_iteration = is_first_iteration and not on_interval
        logging_now = on_interval or is_first_iteration
        # Read Megatron's interval timer before training_log resets it.
        interval_s = _training.get_timers()("interval-time").elapsed(reset=False) if logging_now else 0.0
        with skipped_losses.honest(total_loss_dict, logging_now=logging_now, reset=not is_first_iteration):
            result = training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                                  report_memory_flag, skipped_iter, grad_norm, *rest,
                                  is_first_iteration=is_first_iteration, **kwargs)
        if logging_now:
            report = metrics.report(iteration=iteration, interval_s=interval_s,
                                    learning_rate=learning_rate, grad_norm=grad_norm,
                                    reset=not is_first_iteration)
            _training.print_rank_last(format_metrics(report))
            if interval_skipped and not args.fp16:  # (fp16 skips while its loss scale settles)
                _training.print_rank_last(interval_skipped_warning(interval_skipped, interval_reasons, args,
                                                                   _LAST_NORM[0]))
            elif not _ITERATIONS["trained"]:
                _training.print_rank_last(run_skipped_warning(_ITERATIONS["skipped"], _SKIPPED, args, _LAST_NORM[0],
                                                              float(loss_scale)))
            if not is_first_iteration:
                interval_reasons.clear()
            write_scalars(report, plan_scalars(_handoff(run).summary), iteration)
        return result

    return training_log_with_metrics


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _is_last_rank() -> bool:
    if not torch.distributed.is_initialized():
        return True
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def _max_over_ranks(value: float) -> float:
    """The largest value over all ranks: a partitioned optimizer step is as slow as its slowest rank."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return float(tensor.item())
