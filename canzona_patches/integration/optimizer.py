"""Canzona on Megatron-Core: the matrix optimizer, built on a run's
:class:`~canzona_patches.integration.setup.CanzonaSetup`.

Hooks (megatron-core 0.19.2):
* ``DistributedDataParallel(full_param_layout=...)`` receives the plan's layouts: stock
  equal shards, each matrix whole in one rank's shard or across shards; the stock
  reduce-scatter delivers the pieces, the host-group engine takes them to each matrix's
  host.
* ``megatron.core.optimizer._get_param_groups_and_buffers`` and
  ``get_standard_config_overrides`` build the same parameter groups (lr/wd multipliers)
  Megatron's own optimizers get.
* ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer`` wraps the Canzona
  inner optimizer unchanged: fp32 main weights for bf16 parameters, gradient clipping by
  the global norm, and the stock parameter all-gather (overlapped when asked).
  :class:`CanzonaDistributedOptimizer` changes three things: it all-gathers the matrix buffer
  too (``DistributedOptimizer.start_param_sync_for_bucket_group_subset`` skips buffers tagged
  ``is_managed_by_layer_wise_optimizer``, the tag DDP's buffer grouping reads); a step whose
  gradients hold inf or NaN is skipped also when no loss scaler would catch it, and one whose norm
  is over ``grad_norm_skip_threshold`` too (0.19.2 honours it in ``ChainedOptimizer.step`` only);
  and ``step_with_ready_grads`` is its own, so that the inner step receives one frozen
  :class:`~megatron.canzona.runtime.host_groups.StepFactors` (Megatron's ``optimizer-inner-step``,
  ``optimizer-copy-main-to-model-params`` and ``params-all-gather`` timers around the same calls:
  ``_copy_main_params_to_model_params``, and the parameter all-gather unless it overlaps the next
  forward or ``_defer_param_sync`` is set).

* Under ``--use-megatron-fsdp`` ``DistributedOptimizer`` leaves buffers, gradients and main weights
  to Megatron-FSDP (``ddp_config.use_megatron_fsdp``): the inner optimizer steps its ``DTensor``
  parameters, bound by :func:`~canzona_patches.integration.binding.bind_fsdp`, Muon's momentum kept
  on the holders; after the step its ``copy_main_weights_to_model_weights`` and each chunk's
  ``start_param_sync`` run, as in Megatron's own FSDP step.

The step's path, once per iteration: ``prepare_grads`` (inf/NaN) -> ``clip_grad_norm`` (or, chained,
``get_grad_norm``) makes the step's :class:`NormOutcome` (:func:`norm_outcome`, one rule for the
dense and the chained optimizers) -> ``step_with_ready_grads`` passes :func:`step_factors` of it to
the inner step -> :meth:`CanzonaDistributedOptimizer.conclude` counts the early-compute outcome and
asks the speculation policy about the next iteration (a skipped step concludes where it is decided).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from canzona_patches.checkpoints.state import common_state, load_optimizer_state_dict, optimizer_sharded_state_dict
from canzona_patches.errors import CanzonaArgumentError
from canzona_patches.integration.binding import bind_fsdp, bind_plan, group_coordinates
from canzona_patches.integration.early_gather import EarlyCompute, EarlySources
from canzona_patches.integration.early_gather import attach as attach_early_gathers
from canzona_patches.integration.fsdp_gathers import attach_fsdp as attach_fsdp_early_gathers
from canzona_patches.integration.layout import BUFFER_ROUTING_ATTR, is_expert_param, uses_megatron_fsdp
from canzona_patches.integration.setup import CanzonaPart, CanzonaSetup
from canzona_patches.integration.uneven import shard_bounds
from canzona_patches.version import require_pinned_megatron
from megatron.canzona.optim import MATRIX_OPTIMIZERS
from megatron.canzona.planning.memory import STATE_BYTES, early_compute_groups
from megatron.canzona.planning.schedule import Coord
from megatron.canzona.planning.speculation import SpeculationPolicy
from megatron.canzona.runtime.host_groups import HostGroupEngine, StepFactors, all_reduce_over
from megatron.canzona.runtime.optimizer import CanzonaOptimizer, narrow_gathers, narrow_updates

require_pinned_megatron()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.optimizer import (  # noqa: E402
    _get_param_groups_and_buffers,
    get_standard_config_overrides,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range  # noqa: E402
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler  # noqa: E402
from megatron.core.optimizer.optimizer import SEPARATE_GRAD_NORM_GROUPS, ChainedOptimizer  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.utils import get_pg_rank, get_pg_size  # noqa: E402

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- optimizer


class CanzonaDistributedOptimizer(DistributedOptimizer):
    """Megatron's DistributedOptimizer owning every bucket, the matrix buffer included, and
    skipping steps with inf/NaN gradients when no loss scaler checks for them. A bucket of the
    whole layout (tagged by :mod:`canzona_patches.integration.uneven`) gives each rank its planned shard."""

    def __init__(self, inner: CanzonaOptimizer, optimizer_config: Any, *, setup: CanzonaSetup, ranks: _Ranks,
                 model_chunks: list, per_model_buffers: Any) -> None:
        """Megatron's DistributedOptimizer over ``ranks.dp``, then :attr:`canzona`: ``setup``'s plan
        (its expert plan for ``ranks.expert``) bound to this optimizer's shards, and the
        host-group engine the inner optimizer steps with."""
        super().__init__(
            inner, optimizer_config, _grad_scaler(optimizer_config), lambda opt, config=None: opt.init_state(),
            model_chunks=model_chunks, per_model_buffers=per_model_buffers, data_parallel_group=ranks.dp,
            data_parallel_group_gloo=ranks.dp_gloo, data_parallel_group_idx=ranks.dp_idx,
            distributed_optimizer_instance_id=0,
        )
        self.grad_stats_parallel_group = ranks.grad_stats  # what get_megatron_optimizer sets on its own
        plan = setup.plan.experts if ranks.expert else setup.plan
        if self.fsdp:  # Megatron-FSDP's DTensor shards of its buffers, as it built them
            binding = bind_fsdp(plan, [p for group in inner.param_groups for p in group["params"]], model_chunks,
                                coord=ranks.coord, fused_layouts=setup.fused_layouts, tp_strides=setup.tp_strides)
        else:
            binding = bind_plan(plan, self, model_chunks, coord=ranks.coord, fused_layouts=setup.fused_layouts,
                                tp_strides=setup.tp_strides)
        binding = dataclasses.replace(binding, tasks=narrow_updates(
            binding.tasks, math=inner.math, config=inner.config, layouts=binding.layouts, tp_size=plan.tp_size,
            mode=setup.config.tp_mode))
        if setup.config.narrow_gathers:
            binding = dataclasses.replace(binding, tasks=narrow_gathers(
                binding.tasks, math=inner.math, config=inner.config, momentum_on_holders=inner.momentum_on_holders))
        engine = HostGroupEngine(binding.tasks, group=ranks.host, rank_of=ranks.rank_of, coord=ranks.coord,
                                 tp_size=plan.tp_size, mode=setup.config.tp_mode)
        inner.bind(binding.pieces, engine, binding.layouts, binding.names, binding.parts,
                   local=local_elements if self.fsdp else None)
        together = any(task.together is not None for task in binding.tasks)  # the plan's, the same on every rank
        if together:
            inner.tp_all_reduce = all_reduce_over(ranks.tp)
        compute = EarlyCompute(
            compute=inner.stage_compute, discard=inner.discard_staged, scale=self._early_scale,
            groups=early_groups(inner, setup.config.early_compute_bytes, ranks.tp if together else None)
        ) if setup.early_compute[ranks.expert] else None
        if not setup.config.early_gather:
            early = None
        elif self.fsdp:  # the holders keep Muon's momentum: its source is gathered early, speculating
            source = EarlySources(inner.speculative_sources, self._early_scale) if inner.momentum_on_holders else None
            early = attach_fsdp_early_gathers(engine, binding, model_chunks, compute, source)
        else:
            early = attach_early_gathers(engine, binding, model_chunks, compute,
                                         matrices_first=setup.matrices_first and not ranks.expert)
        self.canzona = CanzonaPart(binding=binding, engine=engine, tp_group=ranks.tp, early_gathers=early)
        self.speculation = SpeculationPolicy(setup.config.speculation)
        """When early compute speculates that the clip stays idle (decided after each step)."""
        self.early_steps: collections.Counter[str] = collections.Counter()
        """Steps of a run computing early, by outcome: ``committed`` (computed before the step and
        used), ``recomputed`` (the clip acted), ``skipped`` (the step was), ``not speculated``
        (the policy computed this one in the step)."""
        self._outcome = NO_CLIP
        """What this step's gradient norm decided (:func:`norm_outcome`), made by the norm phase
        of each step and read by the step."""

    @property
    def fsdp(self) -> bool:
        """Whether the chunks are Megatron-FSDP's (``--use-megatron-fsdp``): the optimizer's
        parameters are its ``DTensor`` shards, its buffers and collectives its own."""
        return uses_megatron_fsdp(self.ddp_config)

    qk_clip: Any = None
    """The run's :class:`~canzona_patches.integration.qk_clip.QkClip` (the dense optimizer of a
    run with ``--qk-clip`` or ``--log-max-attention-logit``): applied after the update, before the
    main parameters are copied to the model's."""

    canzona: CanzonaPart
    """This optimizer's part of the run's :class:`~canzona_patches.integration.setup.CanzonaSetup`."""

    syncs_fsdp_model: bool = True
    """Under Megatron-FSDP, whether this optimizer runs the steps Megatron-FSDP takes for the whole
    model (zeroing its gradient buffers; after the update, main weights to model weights and the
    weights' all-gather): the expert optimizer of a chain, stepped last, does them once for both."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.fsdp or self.syncs_fsdp_model:
            super().zero_grad(set_to_none)

    def _early_scale(self) -> tuple[Any, ...]:
        """The factors of the gradients known before the step: the loss scale's inverse."""
        return () if self.grad_scaler is None else (self.grad_scaler.inv_scale,)

    @property
    def computes_early(self) -> bool:
        """Whether this optimizer computes micro-groups before its steps (``--canzona-early-compute``)."""
        early = self.canzona.early_gathers
        return early is not None and early.compute_early

    @property
    def speculates(self) -> bool:
        """Whether anything before its steps assumes the clip stays idle: early compute, or early
        gathers of Muon's source (its momentum on Megatron-FSDP's holders)."""
        early = self.canzona.early_gathers
        return early is not None and (early.compute_early or early.source is not None)

    def conclude(self, *, acted: bool, skipped: bool = False) -> None:
        """The iteration's step is decided: ``acted`` when the clip scaled the gradients or the
        step is ``skipped`` (its staged gathers and early results then go, state untouched). The
        outcome is counted, and the speculation policy decides the next iteration."""
        early = self.canzona.early_gathers
        precomputed = bool(self.canzona.engine.precomputed)
        if skipped and early is not None:
            early.drop()
        if not self.speculates:
            return
        stats = self.optimizer.last_stats
        speculated = early.speculating
        outcome = self.speculation.record(speculated=speculated, acted=acted)
        if speculated and skipped:
            outcome = "skipped" if precomputed else ""
        elif speculated:
            outcome = outcome if stats.early or stats.recomputed else ""
        if outcome:
            self.early_steps[outcome] += 1
        early.speculating = self.speculation.speculate

    def resume_speculation(self, state: dict[str, int]) -> None:
        """The speculation policy as a checkpoint saved it: a resumed run decides as the
        uninterrupted one would have."""
        self.speculation.load(state)
        if self.speculates:
            self.canzona.early_gathers.speculating = self.speculation.speculate

    @classmethod
    def _build_model_gbuf_range(cls, param_and_grad_buffer: Any, bucket_index: int) -> dict:
        """This rank's parameter ranges in a bucket: its planned shard where the bucket has one."""
        bucket = param_and_grad_buffer.buckets[bucket_index]
        bounds = shard_bounds(bucket)
        if bounds is None:
            return super()._build_model_gbuf_range(param_and_grad_buffer, bucket_index)
        rank = param_and_grad_buffer.data_parallel_group.rank()
        shard = Range(bucket.offset + bounds[rank], bucket.offset + bounds[rank + 1])
        return {"param_map": cls._build_model_gbuf_param_range_map(param_and_grad_buffer.param_index_map, shard,
                                                                  bucket.offset)}

    def start_param_sync_for_bucket_group_subset(self) -> None:
        """All-gather every bucket group. Upstream skips groups tagged for the layer-wise
        optimizer; Canzona tags its matrix buffer only so DDP gives it a buffer of its own."""
        for chunk in self.model_chunks:
            for bucket_group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                if bucket_group.buckets:
                    chunk._start_bucket_group_param_sync(bucket_group, force_sync=False)

    def reads_nonfinite_from_norm(self, *, clipping: bool | None = None) -> bool:
        """Whether the global gradient norm Megatron computes to clip also serves as the inf/NaN
        check, so that no second pass over the gradients is made: no loss scaler checks, the norm
        is computed (``clipping``, default whether ``--clip-grad`` is on), and no parameter is
        clipped by a norm group of its own (whose gradients the global norm leaves out)."""
        clipping = self.config.clip_grad > 0.0 if clipping is None else clipping
        return (self.grad_scaler is None and clipping
                and not any(self.has_grad_norm_group(group) for group in SEPARATE_GRAD_NORM_GROUPS))

    def _settle_early(self) -> None:
        """Before Megatron unscales the gradients in place: what early compute still reads of them
        is read (CUDA, a stream wait; only with a loss scaler, the one in-place write before the
        step that a committed early result could see)."""
        if self.grad_scaler is not None and self.canzona.early_gathers is not None:
            self.canzona.early_gathers.settle()

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        self._settle_early()
        found_inf = super().prepare_grads()
        self._outcome = NO_CLIP
        if self.grad_scaler is None and not self.reads_nonfinite_from_norm():
            found_inf = self._nonfinite_grads()
            if found_inf:
                logger.warning(NONFINITE_SKIP)
        if found_inf:
            self.conclude(acted=True, skipped=True)  # the staged gradients go before any state is touched
        return found_inf

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Megatron's norm and clip; what it decided (:func:`norm_outcome`: the factor it applied,
        on the same floats, for the hosts, which apply it to gradients gathered before the step;
        a skip for a norm that is inf or NaN, or over ``grad_norm_skip_threshold``) is this step's."""
        grad_norm = super().clip_grad_norm(clip_grad)
        self.decide(norm_outcome(grad_norm, clip_grad=clip_grad, has_params=bool(self.get_parameters()),
                                 checks_nonfinite=self.reads_nonfinite_from_norm(),
                                 skip_threshold=self.config.grad_norm_skip_threshold))
        return grad_norm

    def decide(self, outcome: NormOutcome) -> None:
        """This step's norm outcome (a chained optimizer gives its parts the joint one); a
        skipped step changes nothing, and its staged gathers and early results go now."""
        self._outcome = outcome
        if outcome.skip is not None:
            if outcome.skip == "threshold":
                logger.info(THRESHOLD_SKIP)
            self.conclude(acted=True, skipped=True)

    def step(self) -> tuple[bool, float | None, int | None]:
        """Megatron's step; one whose norm was inf or NaN reports as a found-inf step does."""
        return _as_found_inf(self, super().step())

    def step_with_ready_grads(self) -> bool:
        """The step with one frozen value of what it needs (:class:`StepFactors`): the hosts
        scale what was gathered early as the holders' gradients were (the loss scale's inverse,
        then the clip factor: Megatron's order), and use what was computed early only where no
        clip acted. QK-clip (:attr:`qk_clip`) on the updated main weights. Then Megatron's own end of a
        step: main parameters to the model's, and the parameter all-gather unless it overlaps the
        next forward."""
        outcome = self._outcome
        if outcome.skip is not None:
            return False
        factors = step_factors(self.grad_scaler, outcome)
        timers = self.config.timers
        if not self.is_stub_optimizer:
            with _timed(timers, "optimizer-inner-step", self.config):
                self.optimizer.step(factors=factors)
        if self.qk_clip is not None:  # every rank: its all-reduce; then the main rows this rank holds
            self.qk_clip.clip()
        if not self.is_stub_optimizer and (not self.fsdp or self.syncs_fsdp_model):
            with _timed(timers, "optimizer-copy-main-to-model-params", self.config):
                if self.config.reuse_grad_buf_for_mxfp8_param_ag:  # the param all-gather reads the grad buffer
                    if not self.config.overlap_param_gather:
                        self._copy_main_params_to_param_buffer()
                else:
                    self._copy_main_params_to_model_params()
        if self.fsdp and self.syncs_fsdp_model:  # Megatron's: start Megatron-FSDP's all-gather of the new weights
            with _timed(timers, "params-all-gather", self.config):
                for chunk in self.model_chunks:
                    chunk.start_param_sync()
        elif not self.ddp_config.overlap_param_gather and not getattr(self, "_defer_param_sync", False):
            with _timed(timers, "params-all-gather", self.config):
                self.start_param_sync_for_bucket_group_subset()
        if self.canzona.early_gathers is not None:
            self.canzona.early_gathers.stepped()
        self.conclude(acted=outcome.clip_factor is not None)
        return True

    # Checkpoints (canzona_patches/checkpoints/state.py): name-keyed global tensors, any DP/TP layout.
    def sharded_state_dict(self, model_sharded_state_dict: Any = None, is_loading: bool = False,
                           sharding_type: str | None = None, metadata: dict | None = None) -> dict:
        """Every Canzona optimizer state as name-keyed ``ShardedTensor``s (``sharding_type`` is
        ignored: this one format reshards across DP and TP)."""
        return optimizer_sharded_state_dict(self, is_loading=is_loading, metadata=metadata)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`sharded_state_dict` described, after ``dist_checkpointing.load``."""
        load_optimizer_state_dict(self, state_dict)

    def state_dict(self) -> dict:
        """The layout-independent part only; tensors go through :meth:`sharded_state_dict`."""
        return {"canzona": common_state(self)}

    def save_parameter_state(self, filename: str) -> None:
        raise CanzonaArgumentError("--canzona checkpoints need --ckpt-format torch_dist (the default)")

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False) -> None:
        raise CanzonaArgumentError("--canzona checkpoints need --ckpt-format torch_dist (the default)")

    def _nonfinite_grads(self) -> bool:
        """Whether a gradient on any rank holds inf or NaN. One fused norm per rank on the
        gradients' device, one all-reduce, one host read per step, whatever the number of
        parameters (an inf or NaN element makes its tensor's norm non-finite)."""
        return _any_rank(self._local_nonfinite_flag(), self.get_grad_stats_parallel_group())

    def _local_nonfinite_flag(self) -> torch.Tensor:
        """1.0 where one of this rank's gradients holds inf or NaN, else 0.0 (on the device)."""
        if self.is_stub_optimizer:
            grads = []
        elif self.fsdp:  # a DTensor shard of no local element has no gradient
            grads = [local_elements(p.grad) for group in self.optimizer.param_groups for p in group["params"]
                     if p.grad is not None]
        else:
            grads = self._collect_main_grad_data_for_unscaling()
        if not grads:
            return torch.zeros(1, device=_collective_device())
        norms = torch.stack(torch._foreach_norm(grads))
        return (~torch.isfinite(norms).all()).to(torch.float32).reshape(1)


def early_groups(inner: CanzonaOptimizer, budget_bytes: int, tp_group: Any = None) -> frozenset[int]:
    """The micro-groups this rank computes early within ``budget_bytes``
    (:func:`~megatron.canzona.planning.memory.early_compute_groups`, as the memory model picks them).
    ``tp_group``: the TP group of ranks that compute matrices together (:attr:`MatrixTask.together`),
    whose Newton-Schulz is a collective among them: the groups every one of them picks (one
    all-reduce at start-up), so that each computes a shared matrix early or in the step alike."""
    engine = inner.engine
    assert engine is not None
    mine = early_compute_groups(
        ((max(t.task.bucket for t in e.tasks), e.index, sum(inner.early_elements(t.key) for b in e.computed for t in b))
         for e in engine.exchanges), budget_bytes // STATE_BYTES)
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return mine
    picked = torch.tensor([e.index in mine for e in engine.exchanges], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(picked, op=dist.ReduceOp.MIN, group=tp_group)
    return frozenset(e.index for e, keep in zip(engine.exchanges, picked.tolist()) if keep)


NONFINITE_SKIP = "Canzona: skipping the optimizer step, a gradient holds inf or NaN"
THRESHOLD_SKIP = "Canzona: skipping the optimizer step, the gradient norm is over grad_norm_skip_threshold"


@dataclass(frozen=True, kw_only=True)
class NormOutcome:
    """What one step's global gradient norm decided for one optimizer."""

    clip_factor: float | None = None
    """The factor the clip applied to the gradients (under 1); ``None``: it did not act."""
    skip: str | None = None
    """Why the step is skipped: ``nonfinite`` (the norm is inf or NaN) or ``threshold`` (over
    ``grad_norm_skip_threshold``); ``None``: it runs."""


NO_CLIP = NormOutcome()


def norm_outcome(grad_norm: float, *, clip_grad: float, has_params: bool, checks_nonfinite: bool,
                 skip_threshold: float) -> NormOutcome:
    """What ``grad_norm`` decides, as Megatron-Core 0.19.2 does on the same floats: a non-finite
    norm skips where it is the inf/NaN check (``checks_nonfinite``); a norm over a finite
    ``skip_threshold`` skips (its chained step's rule, here for every Canzona optimizer); else the
    clip's factor ``clip_grad / (norm + 1e-6)`` acts where it is under 1 and there are
    parameters."""
    if checks_nonfinite and not math.isfinite(grad_norm):
        return NormOutcome(skip="nonfinite")
    if has_params and math.isfinite(skip_threshold) and grad_norm > skip_threshold:
        return NormOutcome(skip="threshold")
    factor = clip_grad / (grad_norm + 1.0e-6) if clip_grad > 0.0 else 1.0
    return NormOutcome(clip_factor=factor) if has_params and factor < 1.0 else NO_CLIP


def step_factors(grad_scaler: Any, outcome: NormOutcome) -> StepFactors:
    """The step's :class:`StepFactors`: the loss scale's inverse, then the clip's factor
    (Megatron's order), and whether what was computed early is the step's own (no clip acted)."""
    scale = [] if grad_scaler is None else [grad_scaler.inv_scale]
    if outcome.clip_factor is not None:
        scale.append(outcome.clip_factor)
    return StepFactors(scale=tuple(scale), commit_early=outcome.clip_factor is None)


@contextlib.contextmanager
def _timed(timers: Any, name: str, config: Any):
    """Megatron's level-1 timer ``name`` around the body (nothing without timers)."""
    if timers is None:
        yield
        return
    timers(name, log_level=1).start(barrier=config.barrier_with_L1_time)
    try:
        yield
    finally:
        timers(name).stop()


def _as_found_inf(optimizer: Any, result: tuple) -> tuple:
    """``optimizer.step()``'s result, or Megatron's found-inf one ``(False, None, None)`` when the
    step's norm came out inf or NaN (it was skipped)."""
    if optimizer._outcome.skip == "nonfinite":
        logger.warning(NONFINITE_SKIP)
        return False, None, None
    return result


def _any_rank(flag: torch.Tensor, group: Any) -> bool:
    """Whether ``flag`` is set on any rank of ``group``: one all-reduce, one host read."""
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


class CanzonaChainedOptimizer(ChainedOptimizer):
    """The dense and the expert Canzona optimizers of an expert-parallel run, stepped as
    Megatron chains its own, checkpointed as one: a single name-keyed state (experts by
    global index), the same as at EP 1, where experts are dense parameters of one optimizer."""

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Both optimizers' gradients. Megatron's chained step computes the joint norm whether
        or not it clips, and that norm is the inf/NaN check where no loss scaler checks; else one
        check for the two (the flags max-reduced together: one host read per step)."""
        found_inf = False
        flags = []
        self._outcome = NO_CLIP
        for part in self.chained_optimizers:
            part._settle_early()
            found_inf |= DistributedOptimizer.prepare_grads(part)
            part._outcome = NO_CLIP
            if part.grad_scaler is None and not part.reads_nonfinite_from_norm(clipping=True):
                flags.append(part._local_nonfinite_flag())
        if flags:
            group = self.chained_optimizers[0].get_grad_stats_parallel_group()
            if _any_rank(torch.stack(flags).amax().reshape(1), group):
                logger.warning(NONFINITE_SKIP)
                found_inf = True
        if found_inf:
            for part in self.chained_optimizers:
                part.conclude(acted=True, skipped=True)  # the staged gradients go before any state is touched
        return found_inf

    _outcome = NO_CLIP

    def get_grad_norm(self) -> float:
        """The joint norm Megatron clips both optimizers by, and what it decides for each
        (:func:`norm_outcome`, Megatron's expressions on the same floats): the factor each
        applies, for its hosts; a skip when the norm is inf or NaN, or over a part's
        ``grad_norm_skip_threshold`` (Megatron's chained step then skips them all)."""
        grad_norm = super().get_grad_norm()
        parts = self.chained_optimizers
        nonfinite = any(part.reads_nonfinite_from_norm(clipping=True) for part in parts)
        outcomes = [norm_outcome(grad_norm, clip_grad=part.config.clip_grad, has_params=bool(part.get_parameters()),
                                 checks_nonfinite=nonfinite, skip_threshold=part.config.grad_norm_skip_threshold)
                    for part in parts]
        skip = next((o.skip for o in outcomes if o.skip is not None), None)
        self._outcome = NormOutcome(skip=skip) if skip is not None else NO_CLIP
        for part, outcome in zip(parts, outcomes):
            part.decide(self._outcome if skip is not None else outcome)
        return grad_norm

    def step_with_ready_grads(self) -> bool:
        return False if self._outcome.skip is not None else super().step_with_ready_grads()

    def step(self) -> tuple[bool, float | None, int | None]:
        """Megatron's chained step; one whose norm was inf or NaN reports as a found-inf step does."""
        return _as_found_inf(self, super().step())

    def sharded_state_dict(self, model_sharded_state_dict: Any = None, is_loading: bool = False,
                           sharding_type: str | None = None, metadata: dict | None = None) -> dict:
        """One :func:`optimizer_sharded_state_dict` over both optimizers (no ``chained_i.``
        prefixes: keys must not depend on how many optimizers a layout has)."""
        return optimizer_sharded_state_dict(self, is_loading=is_loading, metadata=metadata)

    def load_state_dict(self, state_dict: dict) -> None:
        load_optimizer_state_dict(self, state_dict)

    def state_dict(self) -> dict:
        return {"canzona": common_state(self)}


def local_elements(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a parameter or gradient: a ``DTensor``'s local shard (Megatron-FSDP's
    optimizer parameters and their gradients), else the tensor (no copy either way)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _collective_device() -> torch.device:
    """Where a rank's small collective tensors live: its CUDA device (NCCL) or the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _route_groups(groups: list[dict], weight_decay: float) -> list[dict]:
    """Split each Megatron param group into a matrix group and an elementwise group; every
    rank makes the same groups, as checkpoints require.

    Each group starts with the weight decay Megatron's scheduler would give it
    (``weight_decay * wd_mult``: none for norms and biases), so the first step is right
    also when no ``OptimizerParamScheduler`` drives the optimizer."""
    routed = []
    for group in groups:
        for matrix in (True, False):
            params = [p for p in group["params"] if routed_to_matrices(p) == matrix]
            if params:
                routed.append({**group, "params": params, "matrix": matrix,
                               "weight_decay": weight_decay * group.get("wd_mult", 1.0)})
    return routed


def routed_to_matrices(param: torch.nn.Parameter) -> bool:
    """Whether the plan updates ``param`` as a matrix (its tag, on the model parameter behind a
    Megatron-FSDP ``DTensor`` parameter)."""
    return bool(getattr(getattr(param, "orig_param", param), BUFFER_ROUTING_ATTR))


def _grad_scaler(config: Any):
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale, growth_factor=2.0,
            backoff_factor=0.5, growth_interval=config.loss_scale_window, hysteresis=config.hysteresis,
        )
    return None


@dataclass(frozen=True, kw_only=True)
class _Ranks:
    """The process groups and coordinates of one Canzona DistributedOptimizer."""

    expert: bool
    dp: Any
    dp_gloo: Any
    dp_idx: int
    tp: Any
    host: Any
    coord: Coord
    rank_of: dict[Coord, int]
    grad_stats: Any


def build_canzona_optimizer(optimizer_config: Any, model_chunks: list, setup: CanzonaSetup):
    """The Canzona optimizer for DDP-wrapped chunks built with ``setup``'s layouts.

    Megatron's DistributedOptimizer wraps one :class:`CanzonaOptimizer` (the matrix
    optimizer's math plus a host-group engine over the tensor-and-data-parallel group, whose
    ranks ``setup.host_ranks`` maps, or the ranks tell each other: a collective).

    With expert parallelism, as in Megatron, a second one over the expert buffers and the
    expert-data-parallel group (its host group that group, or at expert TP > 1 the EP rank's
    expert-DP x expert-TP ranks) is chained after it
    (:class:`CanzonaChainedOptimizer`). Under Megatron-FSDP, which shards the expert buckets over
    the expert-data-parallel group, the same two; the expert one, stepped last, runs
    Megatron-FSDP's whole-model steps (:attr:`CanzonaDistributedOptimizer.syncs_fsdp_model`)."""
    if not optimizer_config.use_distributed_optimizer:
        raise ValueError("--canzona needs the distributed optimizer: pass --use-distributed-optimizer")
    experts = [n for chunk in model_chunks for n, p in chunk.named_parameters()
               if is_expert_param(getattr(p, "orig_param", p))]  # (Megatron-FSDP's DTensors: their model parameters)
    if experts and setup.plan.experts is None:
        raise ValueError(
            f"the model has expert-parallel parameters ({experts[0]} and {len(experts) - 1} more) but the Canzona "
            "plan has no expert layout: plan with the run's --expert-model-parallel-size")
    pgs = ProcessGroupCollection.setup_process_groups_for_optimizer(None, model_chunks, True)
    dense_tp = ProcessGroupCollection.use_mpu_process_groups().tp
    # With several distributed-optimizer instances (Megatron's), each plans, hosts and steps over its
    # own DP (x CP) ranks, as Megatron's buffers shard over them; the instances' gradients are
    # all-reduced by Megatron after each reduce-scatter.
    coord = (get_pg_rank(pgs["intra_dp_cp_group"]), get_pg_rank(dense_tp))
    if _instances(pgs) == 1:
        host_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        rank_of = setup.host_ranks if setup.host_ranks is not None else group_coordinates(host_group, coord)
    else:
        host_group, rank_of = _host_group(pgs, expert=False)
    dense = _canzona_dist_optimizer(optimizer_config, model_chunks, setup, _Ranks(
        expert=False, dp=pgs["intra_dp_cp_group"], dp_gloo=pgs["intra_dp_cp_group_gloo"], dp_idx=get_pg_rank(pgs["mp_group"]),
        tp=dense_tp, host=host_group, coord=coord, grad_stats=pgs["intra_dist_opt_group"], rank_of=rank_of))
    if not experts:
        return dense
    edp_group = pgs["intra_expt_dp_group"]
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    if get_pg_size(etp_group) == 1:
        # a host (expert-DP rank, 0) is that rank of the expert-DP group
        expert_host, expert_coord = edp_group, (get_pg_rank(edp_group), 0)
        expert_rank_of = {(d, 0): d for d in range(setup.plan.experts.dp_size)}
    else:  # expert TP: a host of the expert-DP x expert-TP ranks of this EP rank (and stage, and instance)
        expert_host, expert_rank_of = _host_group(pgs, expert=True)
        expert_coord = (get_pg_rank(edp_group), get_pg_rank(etp_group))
    expert = _canzona_dist_optimizer(optimizer_config, model_chunks, setup, _Ranks(
        expert=True, dp=edp_group, dp_gloo=pgs["intra_expt_dp_group_gloo"], dp_idx=get_pg_rank(pgs["expt_tp_pp_group"]),
        tp=etp_group, host=expert_host, coord=expert_coord, grad_stats=pgs["intra_dist_opt_group"],
        rank_of=expert_rank_of))
    dense.syncs_fsdp_model = False
    # The chained optimizer gives both the joint clip factor (get_grad_norm).
    return CanzonaChainedOptimizer([dense, expert])


def _instances(pgs: dict) -> int:
    """Distributed-optimizer instances of the run (1 without several)."""
    inter = pgs.get("inter_dist_opt_group")
    return 1 if inter is None else get_pg_size(inter)


def _host_group(pgs: dict, *, expert: bool) -> tuple[Any, dict[Coord, int]]:
    """A host group Megatron has none of, and its ``(dp, tp) -> rank in it`` table: the ranks of this
    rank's pipeline stage and distributed-optimizer instance (dense: DP x CP x TP), or of its EP rank
    too (``expert``: expert DP x expert TP). Every group is made once, here, by every rank in the
    same order, from Megatron's rank order (tp-cp-ep-dp-pp, its default; checked against the groups
    Megatron made): no collective, so a fake-backend dry run builds them too. A group's ranks go
    tensor-parallel fastest, so ``(d, t)`` is its member ``d x TP + t``."""
    from megatron.core.parallel_state import RankGenerator

    world, pp = dist.get_world_size(), parallel_state.get_pipeline_model_parallel_world_size()
    if expert:
        tp, ep = parallel_state.get_expert_tensor_parallel_world_size(), parallel_state.get_expert_model_parallel_world_size()
        generator = RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        whole, dp_group, tp_group = generator.get_ranks("tp-dp"), pgs["intra_expt_dp_group"], \
            parallel_state.get_expert_tensor_parallel_group()
    else:
        tp, cp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_context_parallel_world_size()
        generator = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        whole, dp_group, tp_group = generator.get_ranks("tp-cp-dp"), pgs["intra_dp_cp_group"], \
            parallel_state.get_tensor_model_parallel_group()
    instances = _instances(pgs)
    size = len(whole[0]) // instances  # an instance's DP ranks are a contiguous block of the group's
    groups = [ranks[i * size:(i + 1) * size] for ranks in whole for i in range(instances)]
    made, _ = dist.new_subgroups_by_enumeration(groups)
    mine = next(ranks for ranks in groups if dist.get_rank() in ranks)
    coord = (get_pg_rank(dp_group), get_pg_rank(tp_group))
    expected = set(dist.get_process_group_ranks(dp_group)) | set(dist.get_process_group_ranks(tp_group))
    if not expected <= set(mine) or mine.index(dist.get_rank()) != coord[0] * tp + coord[1]:
        raise RuntimeError("Megatron's process groups do not follow its default rank order tp-cp-ep-dp-pp, which "
                           "Canzona's host groups assume here: drop --use-tp-pp-dp-mapping")
    return made, {(d, t): d * tp + t for d in range(size // tp) for t in range(tp)}


def _canzona_dist_optimizer(optimizer_config: Any, model_chunks: list, setup: CanzonaSetup,
                            ranks: _Ranks) -> CanzonaDistributedOptimizer:
    """One DistributedOptimizer around a :class:`CanzonaOptimizer`: the dense buffers over the
    data-parallel group, or (``ranks.expert``) the expert buffers over the expert-data-parallel one."""
    fsdp = uses_megatron_fsdp(model_chunks[0].ddp_config)
    groups, buffers = _get_param_groups_and_buffers(
        model_chunks, model_chunk_offset=0, config=optimizer_config,
        config_overrides=get_standard_config_overrides(optimizer_config),
        # Megatron-FSDP's DTensor parameters do not carry the expert tag (split below, by their model
        # parameters'), and it keeps every bucket in one buffer, which DistributedOptimizer does not read.
        filter_fn=lambda g: fsdp or g["is_expert_parallel"] == ranks.expert,
        buffer_name="expert_parallel_buffers" if ranks.expert and not fsdp else "buffers",
    )
    if fsdp:
        groups = [{**group, "params": params} for group in groups
                  if (params := [p for p in group["params"] if is_expert_param(p.orig_param) == ranks.expert])]
    cfg = setup.config
    # Under Megatron-FSDP Muon's momentum stays in its shards, as AdamW's moments do: the hosts
    # keep no copy of what the holders' bytes already are (docs/fsdp.md#memory).
    inner = CanzonaOptimizer(
        _route_groups(groups, optimizer_config.weight_decay), math=cfg.optimizer, lr=optimizer_config.lr,
        weight_decay=optimizer_config.weight_decay, config=cfg.matrix, adamw_config=cfg.adamw,
        momentum_on_holders=fsdp and MATRIX_OPTIMIZERS[cfg.optimizer].from_source_fn is not None,
    )
    return CanzonaDistributedOptimizer(inner, optimizer_config, setup=setup, ranks=ranks, model_chunks=model_chunks,
                                       per_model_buffers=buffers)
