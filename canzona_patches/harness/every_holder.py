"""The peer design under Megatron-FSDP that ``tools/bench_step.py --fsdp`` measures Canzona against:
every matrix that spans shards is all-gathered to every rank holding a piece of it, and each of them
runs Muon on the whole matrix and keeps its own rows of the result (the open upstream attempt,
NVIDIA/Megatron-LM #4486). A matrix inside one shard is updated by its one holder. Elementwise
parameters take AdamW where they lie.

A benchmark baseline, not a product: TP 1 (Newton-Schulz of a TP shard would not be the matrix's),
no clip, no loss scale, every holder keeping the whole matrix's momentum as #4486's does. The
all-gather runs over the DP group with each rank's piece padded to the largest (a rank holding none
sends zeros), so its bytes are what such an all-gather moves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from canzona_patches.integration.layout import is_matrix_param
from megatron.canzona.optim import AdamWConfig, AdamWState, MuonConfig, MuonState, adamw_foreach, apply_update, muon_update


class EveryHolderMuon:
    """Megatron-FSDP's optimizer parameters stepped as the peer design does; ``step`` has the
    signature of a Megatron optimizer's (applied, grad norm, zeros)."""

    def __init__(self, ddp_model: Any, geometry: dict[str, tuple[Any, tuple[int, ...], tuple]], *, config: MuonConfig,
                 adamw: AdamWConfig, lr: float, weight_decay: float, dp_group: Any) -> None:
        self.model, self.geometry, self.config, self.adamw = ddp_model, geometry, config, adamw
        self.lr, self.weight_decay, self.group = lr, weight_decay, dp_group
        self.rank = dist.get_rank(dp_group)
        self.momentum: dict[str, MuonState] = {}
        self.moments: dict[str, AdamWState] = {}
        self.bytes_sent = 0
        """Bytes this rank sent in the last step's all-gathers."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Megatron-FSDP zeroes its own gradient buffers (``zero_grad_buffer``)."""

    @torch.no_grad()
    def step(self) -> tuple[bool, None, None]:
        self.bytes_sent = 0
        params, grads, states = [], [], []
        for name, (param, shape, pieces) in self.geometry.items():
            mine = next(((lo, hi) for rank, lo, hi in pieces if rank == self.rank), None)
            if not is_matrix_param(name, param):
                if mine is not None and param.grad is not None:
                    local = param.to_local().view(-1)
                    params.append(local)
                    grads.append(param.grad.to_local().view(-1))
                    states.append(self.moments.setdefault(name, AdamWState.create(local.shape)))
                continue
            full = self._gathered(param, shape, pieces, mine)
            if mine is None:
                continue
            state = self.momentum.setdefault(name, MuonState.create(shape))
            direction = muon_update(full, state, self.config).reshape(-1)
            lo, hi = mine
            apply_update(param.to_local().view(-1), direction[lo:hi], lr=self.lr, weight_decay=self.weight_decay)
        if params:
            adamw_foreach(params, grads, states, self.adamw, lr=self.lr, weight_decay=0.0)
        self.model.param_and_grad_buffer.copy_main_weights_to_model_weights()
        self.model.start_param_sync()
        return True, None, None

    def _gathered(self, param: Any, shape: tuple[int, ...], pieces: tuple, mine: tuple[int, int] | None) -> torch.Tensor:
        """The whole gradient of a matrix: its pieces all-gathered where it spans shards."""
        if len(pieces) == 1:  # inside one shard: its holder has it all
            return param.grad.to_local().view(shape) if mine is not None else torch.empty(0)
        size = max(hi - lo for _, lo, hi in pieces)
        send = torch.zeros(size)
        if mine is not None:
            local = param.grad.to_local().view(-1)
            send[:local.numel()] = local
        received = [torch.empty(size) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(received, send, group=self.group)
        self.bytes_sent += send.numel() * send.element_size() * (len(received) - 1)
        full = torch.empty(int(torch.tensor(shape).prod()))
        for rank, lo, hi in pieces:
            full[lo:hi] = received[rank][:hi - lo]
        return full.view(shape)
