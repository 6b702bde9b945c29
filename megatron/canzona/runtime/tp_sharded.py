"""Inner optimizers for Megatron-Core's DistributedOptimizer at tensor-parallel size > 1.

Under a Canzona layout each flat shard parameter the DistributedOptimizer hands its inner
optimizer is a whole *local* matrix: this TP rank's shard of a TP-sharded weight. These
classes extend :class:`~megatron.canzona.runtime.sharded.FlatMatrixViews`: TP-sharded
matrices go through :class:`~megatron.canzona.runtime.tp_async.TPEngine` (gathered to their
host TP rank, updated there with the full-matrix math, scattered back), while matrices
that are not TP-sharded and the elementwise (AdamW) parameters are updated locally as at
TP 1. Optimizer state of a TP-sharded matrix lives only on its host, at full size
(``sync`` mode keeps it on every TP rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.canzona.optim import SOAP, AdamWState, Muon, Shampoo, merge_pieces, split_pieces
from megatron.canzona.optim.split import FusedLayout
from megatron.canzona.runtime.sharded import FlatMatrixViews
from megatron.canzona.runtime.tp_async import MatrixShard, ShardedMatrix, StepStats, TPEngine, TPMode


@dataclass(frozen=True, kw_only=True)
class TPMatrixInfo:
    """A TP-sharded matrix parameter: its schedule entry and how its host splits it."""

    matrix: ShardedMatrix
    """Name, local shape, partition dim, host and micro-group (from the plan)."""
    layout: FusedLayout | None = None
    """Layout of the *full* matrix the host splits into separately optimized pieces (global
    Q/K/V or gate/up); ``None`` optimizes the whole matrix."""


class TPFlatMatrixViews(FlatMatrixViews):
    """Flat whole-local-matrix shard parameters; TP-sharded ones are updated through the
    engine. Call :meth:`bind_matrices`, then :meth:`bind_tensor_parallel`."""

    engine: TPEngine | None = None

    def bind_tensor_parallel(
        self, infos: Mapping[torch.Tensor, TPMatrixInfo], *, tp_group: dist.ProcessGroup, mode: TPMode = "async"
    ) -> None:
        """Declare the TP-sharded matrix parameters and build the engine (collective over
        ``tp_group``: every TP rank must call it with the same schedule)."""
        self._tp = {id(p): info for p, info in infos.items()}
        self._tp_param = {info.matrix.name: p for p, info in infos.items()}
        self.engine = TPEngine([info.matrix for info in infos.values()], tp_group=tp_group, mode=mode)
        self.last_stats = StepStats()

    # Stepping -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        if self.engine is None:
            raise RuntimeError("call bind_tensor_parallel() before stepping a TP optimizer")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_stats = self.engine.step(self._tp_shards(), self._host_compute)
        local = [
            self._infos[id(p)].name
            for g in self.param_groups
            if g["matrix"]
            for p in g["params"]
            if p.grad is not None and id(p) not in self._tp
        ]
        for group in self.param_groups:
            self._step_matrices(group)
            self._step_elementwise(group)
        self.last_step_updates = list(self.last_stats.computed) + local
        return loss

    def _tp_shards(self) -> dict[str, MatrixShard]:
        """This rank's local views of every TP-sharded matrix, with its group's lr and wd."""
        shards = {}
        self._group_of: dict[str, dict[str, Any]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                info = self._tp.get(id(p))
                if info is None:
                    continue
                if p.grad is None:
                    raise RuntimeError(
                        f"{info.matrix.name} has no gradient; every TP rank must step every TP-sharded matrix"
                    )
                shards[info.matrix.name] = MatrixShard(
                    param=self._as_matrix(p, p), grad=self._as_matrix(p, p.grad),
                    lr=group["lr"], weight_decay=group["weight_decay"],
                )
                self._group_of[info.matrix.name] = group
        return shards

    def _host_compute(self, names: Sequence[str], full_grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Full-matrix directions for the matrices this rank hosts in one micro-group:
        split fused ones, batch same-shape pieces (per config), merge back."""
        by_config: dict[int, tuple[Any, list]] = {}
        splits: list[tuple[torch.Tensor, FusedLayout | None, int]] = []
        for name, grad in zip(names, full_grads):
            param, group = self._tp_param[name], self._group_of[name]
            layout = self._tp[id(param)].layout
            pieces = split_pieces(grad, layout)
            states = self._piece_states(param, pieces, group["config"])
            jobs = by_config.setdefault(id(group["config"]), (group["config"], []))[1]
            jobs.extend((param, i, piece, state) for i, (piece, state) in enumerate(zip(pieces, states)))
            splits.append((param, layout, len(pieces)))
        directions: dict[tuple[int, int], torch.Tensor] = {}
        for config, jobs in by_config.values():
            directions.update(self._run_jobs(jobs, config))
        return [
            merge_pieces([directions[(id(param), i)] for i in range(count)], layout)
            for param, layout, count in splits
        ]

    def _step_matrices(self, group: dict[str, Any]) -> None:
        """Local update of the matrices that are not TP-sharded (as at TP 1)."""
        local = [p for p in group["params"] if id(p) not in self._tp]
        if local:
            super()._step_matrices({**group, "params": local})

    # State ----------------------------------------------------------------------------
    def init_state(self) -> None:
        """Zero state where none exists; a TP-sharded matrix gets full-size state on the
        rank(s) that compute it and none elsewhere."""
        for group in self.param_groups:
            for p in group["params"]:
                if self.state[p]:
                    continue
                info = self._tp.get(id(p))
                if info is not None:
                    assert self.engine is not None, "bind_tensor_parallel() first"
                    if self.engine.computes(info.matrix):
                        shape = info.matrix.full_shape(self.engine.tp_size)
                        full = torch.zeros(shape, dtype=p.dtype, device=p.device)
                        self._piece_states(p, split_pieces(full, info.layout), group["config"])
                elif group["matrix"]:
                    self._piece_states(p, split_pieces(self._as_matrix(p, p), group["fused_layout"]), group["config"])
                else:
                    self.state[p].update(AdamWState.create(p.shape, device=p.device, grad_dtype=p.dtype).as_dict())


class CanzonaTPMuon(TPFlatMatrixViews, Muon):
    """Muon over flat local-matrix shard parameters, TP-sharded matrices on their hosts."""


class CanzonaTPShampoo(TPFlatMatrixViews, Shampoo):
    """Shampoo over flat local-matrix shard parameters, TP-sharded matrices on their hosts."""


class CanzonaTPSOAP(TPFlatMatrixViews, SOAP):
    """SOAP over flat local-matrix shard parameters, TP-sharded matrices on their hosts."""


TP_SHARDED_OPTIMIZERS: dict[str, type[TPFlatMatrixViews]] = {
    "muon": CanzonaTPMuon,
    "shampoo": CanzonaTPShampoo,
    "soap": CanzonaTPSOAP,
}
"""Inner optimizer class per matrix optimizer name at TP > 1. To add one, subclass
TPFlatMatrixViews and the single-device optimizer, and register it here."""

