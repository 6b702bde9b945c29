"""The inner optimizer Megatron-Core's DistributedOptimizer wraps under ``--canzona``.

One class serves Muon, Shampoo and SOAP at any DP and TP size: it is the matrix
optimizer's math (:data:`~megatron.canzona.optim.MATRIX_OPTIMIZERS`) plus a
:class:`~megatron.canzona.runtime.host_groups.HostGroupEngine`.

Megatron's distributed optimizer hands its inner ``torch.optim.Optimizer`` flat fp32 slices
of the parameters in this rank's DP shard: whole parameters, or pieces of those that lie
across shards. Each matrix piece is declared once (:meth:`CanzonaOptimizer.bind`) as a
range of a host-group task; each step the engine gathers every matrix to its host, calls
:meth:`CanzonaOptimizer._host_compute` there (fused matrices split into their pieces,
same-shape pieces batched) and hands every piece its slice of the direction. Elementwise
parameters take AdamW where they are. Under Megatron-FSDP the parameters are ``DTensor`` shards of
its buffers (``bind(local=...)`` gives their local elements) and Muon's momentum stays with them
(``momentum_on_holders``). Matrix state lives only on the ranks that compute a
matrix, at full size, keyed by task (:attr:`CanzonaOptimizer.matrix_state`).

Muon iterated in bf16 gives a whole matrix's direction exactly in bf16 before its shape scale:
:func:`narrow_updates` marks those tasks, the host returns them unscaled, the scatter carries
them in bf16 (half of fp32's bytes) and every rank applies ``scale * D``, the product the host
would have made: bit for bit the same update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron.canzona.optim import (
    MATRIX_OPTIMIZERS,
    AdamWConfig,
    AdamWState,
    MatrixOptimizer,
    MuonConfig,
    merge_pieces,
    split_pieces,
)
from megatron.canzona.optim.common import state_dtype_for
from megatron.canzona.optim.config import resolve_dtype
from megatron.canzona.optim.muon import muon_from_normalized, muon_from_source_sharded, muon_scale, muon_source_
from megatron.canzona.optim.newton_schulz import AllReduce
from megatron.canzona.optim.split import FusedLayout, GateUpLayout, QKVLayout
from megatron.canzona.planning.comm import NARROW_DTYPE_BYTES
from megatron.canzona.runtime.host_groups import (
    HostGroupEngine,
    LocalPiece,
    MatrixTask,
    StepFactors,
    StepStats,
    direction_elements,
)


@dataclass(frozen=True)
class PieceRef:
    """What (part of) a flat matrix shard parameter is: elements ``[lo, hi)`` of a task's
    local tensor, starting at ``offset`` in the shard."""

    key: str
    lo: int
    hi: int
    offset: int = 0


class CanzonaOptimizer(MatrixOptimizer):
    """Matrix optimizer ``math`` through host groups, AdamW for the elementwise parameters.

    Param groups carry ``matrix`` (True for matrix pieces) besides the usual ``lr`` and
    ``weight_decay``; call :meth:`bind` before the first step.
    """

    def __init__(
        self, params: Iterable[dict[str, Any]], *, math: str, lr: float, weight_decay: float, config: Any,
        adamw_config: AdamWConfig = AdamWConfig(), momentum_on_holders: bool = False,
    ) -> None:
        """``momentum_on_holders``: Muon's momentum (Muon's, AdaMuon's, NorMuon's) is kept by the
        ranks holding each matrix's elements, in their layout, and updated there
        (:func:`~megatron.canzona.optim.muon.muon_source_`); the hosts gather the Newton-Schulz
        input instead of the gradient and keep only the rest of the state (none for Muon). The
        same operations in the same order: the same bits."""
        if math not in MATRIX_OPTIMIZERS:
            raise ValueError(f"unknown matrix optimizer {math!r}; choose one of {tuple(MATRIX_OPTIMIZERS)}")
        kind = MATRIX_OPTIMIZERS[math]
        self.math = math
        self.config_type, self.state_type = kind.config_type, kind.state_type
        self.update_fn = kind.update_fn  # type: ignore[misc]  (a plain function on the instance)
        self.direction_fn, self.advance_fn = kind.direction_fn, kind.advance_fn  # type: ignore[misc]
        self.momentum_on_holders = momentum_on_holders
        if momentum_on_holders:
            if kind.from_source_fn is None:
                raise ValueError(f"{math} has no momentum before its matrix step for the holders to keep")
            self.state_type, self.update_fn = kind.source_state_type, kind.from_source_fn  # type: ignore[misc]
            self.direction_fn = self.advance_fn = None  # type: ignore[misc]
        super().__init__(params, lr=lr, weight_decay=weight_decay, config=config, adamw_config=adamw_config,
                         batch_same_shape=True)
        self.config = config
        self.matrix_state: dict[str, dict[str, Any]] = {}
        self.engine: HostGroupEngine | None = None
        self.last_stats = StepStats()
        self.last_step_updates: list[str] = []
        self._unscaled: MuonConfig | None = None
        """:func:`unscaled` of the config, made at the first step with a narrow task."""
        self._local: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.tp_all_reduce: AllReduce | None = None
        """Sums a tensor in place over this rank's TP group: how the shards of a matrix its TP ranks
        compute together (:attr:`MatrixTask.together`) sum their Gram matrices; set before the first
        step where there are such tasks."""

    def bind(
        self, pieces: Mapping[torch.Tensor, Sequence[PieceRef]], engine: HostGroupEngine,
        layouts: Mapping[str, FusedLayout | None], names: Mapping[str, str] | None = None,
        parts: Mapping[str, tuple[int, int]] | None = None, local: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Declare every matrix piece of the param groups and the engine that runs them.

        ``pieces``: per shard parameter, the task ranges its elements hold (one, or one per part
        of a parameter hosted in parts; none where this rank holds no element of it). ``layouts``
        gives, per task key, how the host splits the full matrix into separately optimized pieces
        (Q/K/V, gate/up) or ``None``; ``names`` the parameter name reported for each task key
        (default: the key); ``parts`` the ``(part, parts)`` of each task hosted in parts;
        ``local`` the tensor of this rank's elements of a parameter or gradient (Megatron-FSDP's
        ``DTensor`` shards; default: the tensor itself, the distributed optimizer's flat shards)."""
        refs = {id(p): tuple(r) for p, r in pieces.items()}
        declared = {(ref.key, ref.lo) for rs in refs.values() for ref in rs}
        for group in self.param_groups:
            for p in group["params"]:
                if group["matrix"] and id(p) not in refs:
                    raise ValueError("a matrix parameter of the optimizer was not declared to bind(); re-plan the layout")
        held = {(t.key, lo) for t in engine.tasks for lo, _ in engine.holds(t)}
        if declared != held:
            diff = sorted(declared ^ held)[:3]
            raise ValueError(f"this rank's matrix pieces and the host-group schedule disagree at {diff}; "
                             "the DDP layout must be the plan's")
        missing = [t.key for t in engine.tasks if engine.computes(t) and t.key not in layouts]
        if missing:
            raise ValueError(f"no fused layout given for {missing[:3]}")
        together = [t.key for t in engine.tasks if t.together is not None]
        if together and (self.math != "muon" or not self.momentum_on_holders
                         or any(layouts.get(key) is not None for key in together)):
            raise ValueError(f"{together[0]}: a matrix its TP ranks compute together is Muon's, one matrix (no "
                             "split layout), its momentum on the holders (Megatron-FSDP)")
        self._refs, self.engine, self._layouts = refs, engine, dict(layouts)
        self._local = local
        self._names = dict(names or {})
        self._parts = dict(parts or {})
        self._tasks = {t.key: t for t in engine.tasks}

    # State ---------------------------------------------------------------------------------
    def _state_of(self, owner: Any) -> dict[str, Any]:
        return self.matrix_state.setdefault(owner, {})

    def computed_tasks(self) -> list[MatrixTask]:
        """The tasks this rank computes, hence keeps state for."""
        engine = self._engine()
        return [t for t in engine.tasks if engine.computes(t)]

    def init_state(self) -> None:
        """Zero state where none exists: full-size matrix state for every task this rank
        computes, allocated once per stack of same-shape pieces exactly as the steps batch
        them (each piece's state dict holds views of it), and AdamW moments for the
        elementwise parameters."""
        device, dtype = self._device_and_dtype()
        engine = self._engine()
        for keys in engine.compute_batches():
            jobs = []
            for key in keys:
                shapes = self._piece_shapes(key)
                self._declare(key, len(shapes))
                jobs.extend((key, i, torch.empty(shape, device="meta", dtype=dtype)) for i, shape in enumerate(shapes))
            for bucket in self._buckets(jobs, self.config):
                if any(self._state_of(key)["pieces"][i] is None for key, i, _ in bucket):
                    self._bucket_state(bucket, self.config, device, dtype)
        for group in self.param_groups:
            if group["matrix"]:
                for p in group["params"] if self.momentum_on_holders else ():
                    if self._refs[id(p)]:
                        self._holder_momentum(p)
                continue
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p].update(AdamWState.create(self._elements(p).shape, device=p.device,
                                                           grad_dtype=p.dtype).as_dict())

    def early_elements(self, key: str) -> int:
        """fp32 elements computing task ``key`` early keeps: its full direction (a narrow one in
        its update dtype: :meth:`HostGroupEngine.precompute`), and a staging copy of its state
        (as :meth:`init_state` makes it) unless the optimizer advances its state at the commit
        (Muon)."""
        shapes = self._piece_shapes(key)
        state = 0 if self.direction_fn is not None else sum(
            t.numel() for shape in shapes for t in self.state_type.create(shape, self.config, device="meta").tensors().values())
        return state + direction_elements(sum(shape.numel() for shape in shapes), self._tasks[key].update_dtype)

    def _piece_shapes(self, key: str) -> list[torch.Size]:
        shape = self._tasks[key].full_shape(self._engine().tp_size)
        return [p.shape for p in split_pieces(torch.empty(shape, device="meta"), self._layouts[key])]

    def split_kinds(self) -> frozenset[str]:
        """The fused matrices this optimizer splits (``qkv``, ``qkv_heads`` where every head is its
        own matrix, ``gate_up``), counting a fused matrix hosted in parts as split (its parts are
        the pieces one host splitting it would optimize): the matrix state's structure, which a
        checkpoint must match."""
        kinds = {_split_kind(layout) for layout in self._layouts.values() if layout is not None}
        if self._parts:
            kinds.add("gate_up")
        return frozenset(kinds - {None})

    def report_name(self, key: str) -> str:
        """The parameter name of task ``key``, with ``#part<k>`` for a part hosted apart."""
        name = self._names.get(key, key)
        return name if key not in self._parts else f"{name}#part{self._parts[key][0]}"

    def _owner_name(self, owner: Any) -> str:
        return self._names.get(owner, owner)

    def _device_and_dtype(self) -> tuple[torch.device, torch.dtype]:
        for group in self.param_groups:
            for p in group["params"]:
                return p.device, state_dtype_for(p.dtype)
        return torch.device("cpu"), torch.float32

    def _engine(self) -> HostGroupEngine:
        if self.engine is None:
            raise RuntimeError("call bind() before using the Canzona optimizer")
        return self.engine

    # Stepping ------------------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None, *,  # type: ignore[override]
             factors: StepFactors = StepFactors()) -> float | None:
        """One update of every parameter; ``factors``: what the step knows of the gradients
        gathered before it (the DistributedOptimizer's, one frozen value per step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._run_step(factors)
        return loss

    def _run_step(self, factors: StepFactors) -> None:
        """Every matrix through the host groups, then AdamW where the elementwise ones are.
        Updates computed before the step become the state if the step used them, else go."""
        self.last_stats = self._engine().step(self._local_pieces(), self._host_compute, factors,
                                              replay=self._replay if self.direction_fn is not None else None)
        if self.last_stats.early:
            self.commit_staged()
        else:
            self.discard_staged()
        self.last_step_updates = [self.report_name(key) for key in self.last_stats.computed]
        for group in self.param_groups:
            self._step_elementwise(group)

    def _elements(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._local is None else self._local(tensor)

    def _local_pieces(self) -> dict[tuple[str, int], LocalPiece]:
        pieces = {}
        for group in self.param_groups:
            if not group["matrix"]:
                continue
            for p in group["params"]:
                refs = self._refs[id(p)]
                if not refs:
                    continue  # none of its elements on this rank
                if p.grad is None:
                    raise RuntimeError(f"a piece of {refs[0].key} has no gradient; every rank must step every piece it holds")
                flat, grad = self._elements(p).view(-1), self._elements(p.grad).view(-1)
                whole = len(refs) == 1 and refs[0].offset == 0 and refs[0].hi - refs[0].lo == flat.numel()
                momentum = self._holder_momentum(p) if self.momentum_on_holders else None
                for ref in refs:
                    size = ref.hi - ref.lo
                    piece_grad = grad if whole else grad.narrow(0, ref.offset, size)
                    if momentum is not None:  # the host gathers the Newton-Schulz input
                        piece_grad = muon_source_(piece_grad, momentum.narrow(0, ref.offset, size), self.config)
                    pieces[(ref.key, ref.lo)] = LocalPiece(
                        param=flat if whole else flat.narrow(0, ref.offset, size), grad=piece_grad,
                        lr=group["lr"], weight_decay=group["weight_decay"],
                    )
        return pieces

    @torch.no_grad()
    def speculative_sources(self, keys: frozenset[str], raw: Mapping[tuple[str, int], torch.Tensor],
                            scale: Sequence[float | torch.Tensor] = ()) -> dict[tuple[str, int], torch.Tensor]:
        """Under ``momentum_on_holders``: the Newton-Schulz input of this rank's pieces of the
        tasks ``keys`` as :meth:`_local_pieces` will make it at the step if no clip acts, from
        the raw gradient pieces ``raw`` times ``scale`` (the factors known before the step) and a
        copy of the momentum, which stays as it is (the step advances it). The same operations
        on the same values: the same bits. Costs a copy of each piece and of its momentum."""
        out = {}
        for group in self.param_groups:
            for p in group["params"] if group["matrix"] else ():
                refs = [ref for ref in self._refs[id(p)] if ref.key in keys]
                # before the first step, the zeros the step will make (made here apart: this may run on a side stream)
                momentum = self.state[p].get("momentum") if refs else None
                if refs and momentum is None:
                    local = self._elements(p)
                    momentum = torch.zeros(local.numel(), device=local.device, dtype=state_dtype_for(local.dtype))
                for ref in refs:
                    size = ref.hi - ref.lo
                    grad = raw[(ref.key, ref.lo)].to(momentum.dtype, copy=True)
                    for factor in scale:
                        grad.mul_(factor)
                    out[(ref.key, ref.lo)] = muon_source_(grad, momentum.narrow(0, ref.offset, size).clone(), self.config)
        return out

    def _holder_momentum(self, param: torch.Tensor) -> torch.Tensor:
        """The momentum of this rank's elements of matrix shard ``param`` (flat, fp32), made at
        first use: under ``momentum_on_holders`` the only matrix state a holder keeps."""
        stored = self.state[param]
        if "momentum" not in stored:
            local = self._elements(param)
            stored["momentum"] = torch.zeros(local.numel(), device=local.device, dtype=state_dtype_for(local.dtype))
        return stored["momentum"]

    def _replay(self, keys: Sequence[str], full_grads: Sequence[torch.Tensor]) -> None:
        """Commit the staged updates of ``keys`` from their full gradients, given again (an
        optimizer whose staged updates leave the state to advance at the commit: Muon)."""
        grads = {(key, i): piece for key, grad in zip(keys, full_grads)
                 for i, piece in enumerate(split_pieces(grad, self._layouts[key]))}
        self.commit_staged(grads, owners=set(keys))

    def stage_compute(self, keys: Sequence[str], full_grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`_host_compute` on staging copies of the state, before the step: the state
        stays as it was until the step commits them (:meth:`commit_staged`)."""
        return self._host_compute(keys, full_grads, staged=True)

    def _host_compute(self, keys: Sequence[str], full_grads: Sequence[torch.Tensor], *,
                      staged: bool = False) -> list[torch.Tensor]:
        """Full-matrix directions: fused matrices split, same-shape pieces batched, merged back;
        a narrow task's unscaled (:func:`narrow_updates`)."""
        jobs, narrow, normalized = [], [], []
        together: dict[tuple[int, bool], list] = {}  # by TP dimension and narrowness, in the keys' order
        counts = []
        for key, grad in zip(keys, full_grads):
            pieces = split_pieces(grad, self._layouts[key])
            self._declare(key, len(pieces))
            task = self._tasks[key]
            if task.together is not None:
                mine = together.setdefault((task.together, task.update_dtype is not None), [])
            elif task.gather_dtype is not None:  # its input normalised by its holders (muon_from_normalized checks)
                mine = normalized
            else:
                mine = narrow if task.update_dtype is not None else jobs
            mine.extend((key, i, piece) for i, piece in enumerate(pieces))
            counts.append(len(pieces))
        directions = self._run_jobs(jobs, self.config, staged=staged)
        if narrow or normalized or any(is_narrow for _, is_narrow in together):
            if self._unscaled is None:
                self._unscaled = unscaled(self.config)
        if narrow:
            directions.update(self._run_jobs(narrow, self._unscaled, staged=staged))
        if normalized:
            directions.update(self._run_jobs(normalized, self._unscaled, staged=staged, update=muon_from_normalized))
        for (dim, is_narrow), shards in together.items():  # the same on every TP peer, in the same order
            directions.update(self._run_jobs(shards, self._unscaled if is_narrow else self.config, staged=staged,
                                             update=self._together_update(dim)))
        return [
            merge_pieces([directions[(id(key), i)] for i in range(count)], self._layouts[key])
            for key, count in zip(keys, counts)
        ]

    def _together_update(self, dim: int) -> Callable[..., torch.Tensor]:
        """Muon's update of a stack of shards of matrices cut along ``dim`` over the TP group,
        computed with the TP peers' (:func:`~megatron.canzona.optim.muon.muon_from_source_sharded`)."""
        reduce, tp_size = self.tp_all_reduce, self._engine().tp_size
        if reduce is None:
            raise RuntimeError("a matrix its TP ranks compute together needs the TP group's all-reduce: set "
                               "CanzonaOptimizer.tp_all_reduce before the first step")

        def update(batch: torch.Tensor, state: Any, config: MuonConfig, refresh: Any = None) -> torch.Tensor:
            rows, cols = batch.shape[-2:]
            shape = (rows * tp_size, cols) if dim == 0 else (rows, cols * tp_size)
            return muon_from_source_sharded(batch, state, config, refresh, all_reduce=reduce,
                                            split_dim=-2 if dim == 0 else -1, shape=shape)
        return update


def unscaled(config: MuonConfig) -> MuonConfig:
    """``config`` with a shape scale of exactly 1: Muon's direction before its scale."""
    return dataclasses.replace(config, scale_mode="none", extra_scale_factor=1.0)


def narrow_updates(tasks: Sequence[MatrixTask], *, math: str, config: Any, layouts: Mapping[str, FusedLayout | None],
                   tp_size: int, mode: str) -> tuple[MatrixTask, ...]:
    """``tasks`` with a narrow update dtype on each whose host's direction is exact in it before
    its scale: Muon iterating in a narrow dtype (the planner's
    :data:`~megatron.canzona.planning.comm.NARROW_DTYPE_BYTES`, which prices the same scatter), a
    whole matrix (no split layout) that moves, the host-group mode (``async``). Its scale is the
    matrix's :func:`muon_scale`."""
    if math != "muon" or mode != "async" or config.ns_dtype not in NARROW_DTYPE_BYTES:
        return tuple(tasks)
    dtype = resolve_dtype(config.ns_dtype)
    out = []
    for task in tasks:
        if layouts.get(task.key) is None and not task.is_local():
            rows, cols = task.matrix_shape(tp_size)
            task = dataclasses.replace(task, update_dtype=dtype, update_scale=muon_scale(
                rows, cols, config.scale_mode, config.extra_scale_factor))
        out.append(task)
    return tuple(out)


def narrow_gathers(tasks: Sequence[MatrixTask], *, math: str, config: Any, momentum_on_holders: bool) -> tuple[MatrixTask, ...]:
    """``tasks`` with a narrow gather (:attr:`MatrixTask.gather_dtype`) on each narrow-update task
    (:func:`narrow_updates`) computed by one host, where the holders keep Muon's momentum (so they
    send its Newton-Schulz input, which they can normalise): Muon's pieces go to their host in the
    Newton-Schulz dtype, half of fp32's bytes, divided by the norm :attr:`MuonConfig.exact_norm`
    makes, which ``config`` must take. ``--canzona-narrow-gathers``."""
    if math != "muon" or not momentum_on_holders:
        raise ValueError("narrow gathers send Muon's normalised Newton-Schulz input, which its holders make only "
                         "where they keep its momentum (--use-megatron-fsdp with --optimizer muon)")
    if not config.exact_norm:
        raise ValueError("narrow gathers divide by the norm summed in integers (MuonConfig.exact_norm), which every "
                         "other matrix of the run must take too: set exact_norm=True")
    return tuple(dataclasses.replace(task, gather_dtype=task.update_dtype, gather_floor=config.eps)
                 if task.update_dtype is not None and task.together is None else task for task in tasks)


def _split_kind(layout: object) -> str | None:
    """The name a checkpoint records for a fused layout (:meth:`CanzonaOptimizer.split_kinds`)."""
    if isinstance(layout, QKVLayout):
        return "qkv_heads" if layout.split_heads else "qkv"
    return "gate_up" if isinstance(layout, GateUpLayout) else None
