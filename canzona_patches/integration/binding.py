"""A Canzona plan bound to a live Megatron-Core model and DistributedOptimizer.

Hooks (megatron-core 0.19.2):
* Megatron's TP attributes on parameters: ``tensor_model_parallel`` and ``partition_dim``
  (0 for column-parallel ``linear_qkv``/``linear_fc1``, 1 for row-parallel
  ``linear_proj``/``linear_fc2``). A ``linear_qkv`` shard holds whole query groups (plain
  concatenation rebuilds the global rows); a gated ``linear_fc1`` shard is ``[gate_r; up_r]``
  of the global ``[gate; up]`` (``stride=2``).
* ``DistributedOptimizer.gbuf_ranges``: per bucket, each parameter's range in this rank's
  shard (``param_map[param]["param"]``), and ``model_param_group_index_map``, which locates
  the flat fp32 shard parameter the inner optimizer steps.
* ``parallel_state``'s tensor-and-data-parallel group (with context parallelism): the ranks
  a plan's hosts range over.
* Under Megatron-FSDP: ``ParamAndGradBuffer.optimizer_named_parameters`` (the ``DTensor``
  parameters the optimizer steps, each with its model parameter as ``orig_param`` and this
  rank's elements of it as its local tensor) and the buffers' indexes
  (:mod:`canzona_patches.integration.fsdp_geometry`).

Nothing here decides anything: the plan says who hosts what and where each piece lies; this
module finds those pieces in the optimizer and checks that DDP built the layout promised.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from canzona_patches.integration.fsdp_geometry import local_spans, read_fsdp_shapes
from canzona_patches.integration.layout import BUFFER_ROUTING_ATTR
from canzona_patches.params import global_param_names, shard_entries
from megatron.canzona.optim.split import FusedLayout
from megatron.canzona.planning import CanzonaPlan
from megatron.canzona.planning.schedule import Coord, plan_schedule
from megatron.canzona.runtime.host_groups import MatrixTask
from megatron.canzona.runtime.optimizer import PieceRef


@dataclass(frozen=True, kw_only=True)
class Binding:
    """Everything the inner optimizer and its engine need, for this rank."""

    tasks: tuple[MatrixTask, ...]
    """Every matrix of the plan, as host-group tasks (a matrix every TP rank holds whole is
    one task per TP rank)."""
    pieces: dict[torch.Tensor, tuple[PieceRef, ...]]
    """This rank's flat matrix shard parameters and the task ranges they hold (one, or one
    per part of a parameter hosted in parts)."""
    layouts: dict[str, FusedLayout | None]
    """Per task: how its host splits the full matrix into separately optimized pieces."""
    names: dict[str, str]
    """Per task: the parameter's global name (:func:`canzona_patches.params.global_param_names`:
    what tests and logs count, and what per-matrix schedules such as refresh offsets derive
    from, so they do not change with the PP or EP layout)."""
    params: dict[str, torch.nn.Parameter]
    """Per task: the model parameter (for checkpoint names)."""
    shard_params: dict[torch.Tensor, torch.nn.Parameter]
    """Per flat shard parameter: its model parameter (whose ``main_grad`` holds the gradient)."""
    shard_starts: dict[torch.Tensor, int]
    """Per flat shard parameter: where its elements start in the model parameter's local tensor."""
    parts: dict[str, tuple[int, int]]
    """Per task of a parameter hosted in parts: ``(its part, how many parts)``; its state is
    that piece of the parameter's matrix state (as when one host splits the fused matrix)."""
    spans: dict[torch.nn.Parameter, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Under Megatron-FSDP, every optimizer parameter (matrix or not) whose shard holds elements on
    this rank -> those elements ``[lo, hi)`` of its flattened local tensor (what checkpoints name)."""


def bind_plan(
    plan: CanzonaPlan, optimizer: Any, model_chunks: list, *, coord: Coord,
    fused_layouts: dict[tuple[int, str], FusedLayout | None], tp_strides: dict[tuple[int, str], int],
) -> Binding:
    """Tasks, pieces and layouts of ``plan`` on this rank (``coord`` = (DP rank, TP rank))
    of a DistributedOptimizer built over DDP chunks laid out by the plan's layouts.
    ``fused_layouts`` and ``tp_strides`` give each matrix parameter's fused layout at full
    (TP-global) size and its TP stride, by (chunk, name) (the run's ``CanzonaSetup``).
    The tasks are the plan's schedule (:func:`~megatron.canzona.planning.schedule.plan_schedule`);
    this only attaches each one's local tensor and checks the model agrees with the plan."""
    modules = [chunk.module for chunk in model_chunks]
    if len(modules) != len(plan.layouts):
        raise RuntimeError(f"the plan has {len(plan.layouts)} model chunks, the model {len(modules)}; re-plan")
    params = {(c, n): p for c, m in enumerate(modules) for n, p in m.named_parameters()}
    found = _plan_tasks(plan, params, global_param_names(model_chunks), fused_layouts, tp_strides)
    where = {p: (c, n) for (c, n), p in params.items()}
    refs: dict[torch.Tensor, tuple[PieceRef, ...]] = {}
    shard_params, shard_starts = {}, {}
    for model_param, shard, _, param_range in shard_entries(optimizer):
        if not getattr(model_param, BUFFER_ROUTING_ATTR, False):
            continue
        shard_params[shard], shard_starts[shard] = model_param, param_range.start
        refs[shard] = found.refs(where[model_param], coord[1], param_range.start, param_range.end, model_param.numel())
    return found.binding(refs, shard_params, shard_starts)


def bind_fsdp(
    plan: CanzonaPlan, inner_params: list[torch.nn.Parameter], model_chunks: list, *, coord: Coord,
    fused_layouts: dict[tuple[int, str], FusedLayout | None], tp_strides: dict[tuple[int, str], int],
) -> Binding:
    """The same as :func:`bind_plan`, for an optimizer over Megatron-FSDP-wrapped chunks: each of
    ``inner_params`` (the optimizer's parameters: Megatron-FSDP's ``DTensor`` parameters, whose
    local tensor is this rank's shard of the parameter in its main-weight buffer) is matched to
    its model parameter (``orig_param``) and to the elements of it this rank holds, as read from
    the buffers Megatron-FSDP built (:func:`~canzona_patches.integration.fsdp_geometry.read_fsdp_buckets`);
    the plan, made from the prediction of the same buffers, must agree piece for piece."""
    if len(model_chunks) != len(plan.layouts):
        raise RuntimeError(f"the plan has {len(plan.layouts)} model chunks, the model {len(model_chunks)}; re-plan")
    params, where, shapes, spans = {}, {}, {}, {}
    for dist_param, (key, span) in local_spans(model_chunks).items():
        params[key], where[dist_param.orig_param] = dist_param, key
        if span is not None:
            spans[dist_param] = span
    for c, chunk in enumerate(model_chunks):
        shapes.update({(c, name): shape for name, shape in read_fsdp_shapes(chunk).items()})
    found = _plan_tasks(plan, params, global_param_names(model_chunks), fused_layouts, tp_strides, shapes)
    refs: dict[torch.Tensor, tuple[PieceRef, ...]] = {}
    shard_params, shard_starts = {}, {}
    for param in inner_params:
        orig = param.orig_param
        if not getattr(orig, BUFFER_ROUTING_ATTR, False):
            continue
        lo, hi = spans.get(param, (0, 0))
        local = param.to_local().numel()
        if local != hi - lo:
            raise RuntimeError(f"{where[orig][1]}: Megatron-FSDP's shard holds {local} elements on DP rank {coord[0]}, "
                               f"its buffer index [{lo}, {hi}); the geometry was read wrong")
        shard_params[param], shard_starts[param] = param, lo
        refs[param] = found.refs(where[orig], coord[1], lo, hi, math.prod(shapes[where[orig]])) if hi > lo else ()
    return dataclasses.replace(found.binding(refs, shard_params, shard_starts), spans=spans)


@dataclass(frozen=True)
class _PlanTasks:
    """The plan's tasks attached to the model's parameters, before the shards are looked at."""

    tasks: list[MatrixTask]
    layouts: dict[str, FusedLayout | None]
    names: dict[str, str]
    params: dict[str, torch.nn.Parameter]
    parts: dict[str, tuple[int, int]]
    keys_of: dict[tuple[int, str], list[tuple[int | None, tuple[int, int] | None, str]]]

    def refs(self, where: tuple[int, str], tp_rank: int, start: int, end: int, numel: int) -> tuple[PieceRef, ...]:
        """The task ranges that elements ``[start, end)`` of parameter ``where`` (chunk, name) are."""
        keys = self.keys_of.get(where)
        if keys is None:
            raise RuntimeError(f"{where[1]} is a matrix the Canzona plan does not schedule; re-plan")
        return _refs(keys, tp_rank, start, end, numel)

    def binding(self, refs: dict[torch.Tensor, tuple[PieceRef, ...]], shard_params: dict, shard_starts: dict) -> Binding:
        return Binding(tasks=tuple(self.tasks), pieces=refs, layouts=self.layouts, names=self.names,
                       params=self.params, parts=self.parts, shard_params=shard_params, shard_starts=shard_starts)


def _plan_tasks(plan: CanzonaPlan, params: dict[tuple[int, str], torch.nn.Parameter],
                global_names: dict[torch.nn.Parameter, str], fused_layouts: dict[tuple[int, str], FusedLayout | None],
                tp_strides: dict[tuple[int, str], int],
                shapes: dict[tuple[int, str], tuple[int, ...]] | None = None) -> _PlanTasks:
    """Every task of the plan's schedule with its local shape, TP dimension and stride, checked
    against the model parameter it names (``params``, by chunk and name; ``shapes``: their local
    shapes where the parameters do not have them, default their own)."""
    tasks, layouts, names, task_params, parts = [], {}, {}, {}, {}
    keys_of: dict[tuple[int, str], list[tuple[int | None, tuple[int, int] | None, str]]] = {}
    counts: dict[tuple[int, str], int] = {}
    for task in plan_schedule(plan).tasks:
        param = params.get((task.chunk, task.name))
        if param is None:
            raise RuntimeError(f"the plan names {task.name} (chunk {task.chunk}), which the model does not have; re-plan")
        sharded = task.tp_sharded or task.together  # one host, or each TP rank its shard
        if sharded != (bool(getattr(param, "tensor_model_parallel", False)) and plan.tp_size > 1):
            raise RuntimeError(f"the plan treats {task.name} as {'' if sharded else 'not '}TP-sharded, the "
                               f"model does not; re-plan with this model's tensor-parallel layout")
        shape = tuple(param.shape) if shapes is None else shapes[(task.chunk, task.name)]
        if task.span is not None:  # a part hosted apart: a block of whole rows of every TP shard
            rows, cols = shape
            lo, hi = task.span
            if lo % cols or hi % cols:
                raise RuntimeError(f"{task.name}: part [{lo}, {hi}) does not cut whole rows of {shape}; re-plan")
            shape = ((hi - lo) // cols, cols)
            counts[(task.chunk, task.name)] = max(counts.get((task.chunk, task.name), 0), task.part + 1)
        tasks.append(MatrixTask(task=task, local_shape=shape,
                                tp_dim=param.partition_dim if task.tp_sharded else None,
                                stride=tp_strides[(task.chunk, task.name)] if task.tp_sharded and task.span is None else 1,
                                together=param.partition_dim if task.together else None))
        layouts[task.key] = None if task.span is not None else fused_layouts[(task.chunk, task.name)]
        names[task.key], task_params[task.key] = global_names[param], param
        keys_of.setdefault((task.chunk, task.name), []).append(
            (None if task.tp_sharded else task.column, task.span, task.key))
    for task in tasks:
        if task.task.span is not None:
            parts[task.key] = (task.task.part, counts[(task.task.chunk, task.task.name)])
    return _PlanTasks(tasks=tasks, layouts=layouts, names=names, params=task_params, parts=parts, keys_of=keys_of)


def _refs(keys: list[tuple[int | None, tuple[int, int] | None, str]], tp_rank: int, start: int, end: int,
          numel: int) -> tuple[PieceRef, ...]:
    """What elements ``[start, end)`` of a parameter's local tensor (one flat shard parameter)
    are: a range of each task of this TP rank that they overlap, with its offset in the shard."""
    out = []
    for column, span, key in keys:
        if column is not None and column != tp_rank:
            continue  # another TP rank's copy
        lo, hi = span or (0, numel)
        a, b = max(start, lo), min(end, hi)
        if a < b:
            out.append(PieceRef(key=key, lo=a - lo, hi=b - lo, offset=a - start))
    return tuple(out)


def group_coordinates(group: Any, coord: Coord) -> dict[Coord, int]:
    """``(dp_rank, tp_rank) -> rank in group`` for every member (a collective over ``group``)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {coord: 0}
    everyone: list[Coord | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, coord, group=group)
    table = {tuple(c): rank for rank, c in enumerate(everyone)}  # type: ignore[arg-type]
    if len(table) != len(everyone):
        raise RuntimeError(f"two ranks of the tensor-and-data-parallel group claim the same (dp, tp): {everyone}")
    return table  # type: ignore[return-value]

