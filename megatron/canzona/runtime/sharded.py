"""Inner optimizers for Megatron-Core's DistributedOptimizer under a Canzona layout.

Megatron's distributed optimizer hands its inner ``torch.optim.Optimizer`` flat fp32
slices of the parameters that fall in this rank's shard. Under a Canzona plan every
matrix in a shard is whole, so each flat slice is a full matrix: these classes view it
back as its 2-D shape and run the batched matrix update, and AdamW on everything else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron.canzona.optim import SOAP, AdamWState, MatrixOptimizer, Muon, Shampoo, split_pieces


@dataclass(frozen=True)
class MatrixInfo:
    """What a flat shard parameter is: the model parameter's name and 2-D shape."""

    name: str
    shape: torch.Size


class FlatMatrixViews(MatrixOptimizer):
    """Matrix parameters are flat views of whole matrices; see :meth:`bind_matrices`."""

    def bind_matrices(self, infos: Mapping[torch.Tensor, MatrixInfo]) -> None:
        """Declare the name and shape of every flat matrix parameter this rank updates."""
        self._infos = {id(p): info for p, info in infos.items()}
        self.last_step_updates: list[str] = []

    def _as_matrix(self, param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        info = self._infos.get(id(param))
        if info is None:
            raise RuntimeError(
                "a matrix parameter reached the optimizer without bind_matrices(); the DP layout "
                "must keep every matrix whole in one shard"
            )
        return tensor.view(info.shape)

    def init_state(self) -> None:
        """Create zero state for every parameter that has none (before loading a checkpoint)."""
        for group in self.param_groups:
            for p in group["params"]:
                if self.state[p]:
                    continue
                if group["matrix"]:
                    self._piece_states(p, split_pieces(self._as_matrix(p, p), group["fused_layout"]), group["config"])
                else:
                    self.state[p].update(AdamWState.create(p.shape, device=p.device, grad_dtype=p.dtype).as_dict())

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        self.last_step_updates = [
            self._infos[id(p)].name
            for g in self.param_groups
            if g["matrix"]
            for p in g["params"]
            if p.grad is not None
        ]
        return super().step(closure)


class CanzonaMuon(FlatMatrixViews, Muon):
    """Muon over flat whole-matrix shard parameters."""


class CanzonaShampoo(FlatMatrixViews, Shampoo):
    """Shampoo over flat whole-matrix shard parameters."""


class CanzonaSOAP(FlatMatrixViews, SOAP):
    """SOAP over flat whole-matrix shard parameters."""


SHARDED_OPTIMIZERS: dict[str, type[FlatMatrixViews]] = {
    "muon": CanzonaMuon,
    "shampoo": CanzonaShampoo,
    "soap": CanzonaSOAP,
}
"""Inner optimizer class per matrix optimizer name. To add one, subclass FlatMatrixViews
and the single-device optimizer, and register it here."""


def init_state_fn(optimizer: FlatMatrixViews, config: object = None) -> None:
    """The ``init_state_fn`` Megatron's DistributedOptimizer calls before loading state."""
    optimizer.init_state()
