#!/usr/bin/env python
"""``pretrain_gpt.py`` recording Megatron-FSDP's geometry: each rank writes, once its model chunk is
wrapped, the planner's descriptions of the chunk's parameters (taken before Megatron-FSDP shards
them), the buckets read from the buffers Megatron-FSDP built and the DP sizes they are sharded over
(``<dir>/rank<r>.json``). Launch it
in place of the entry point with ``FSDP_GEOMETRY_TRACE=<dir>``; tests/e2e/test_megatron_fsdp.py
predicts the buckets from the descriptions and compares. Under ``--canzona`` each rank also writes,
after each step, the optimizer state it holds beside the memory model's prediction
(``<dir>/state<r>.json``, and ``state<r>-experts.json`` for the expert optimizer of an
expert-parallel run), and the step's buffers as its host-group engine counts them
(tests/e2e/test_canzona_fsdp.py compares them)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    import torch

    import pretrain_gpt
    from canzona_patches.integration.fsdp_geometry import read_fsdp_buckets
    from canzona_patches.integration.layout import specs_from_model
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    out = Path(os.environ["FSDP_GEOMETRY_TRACE"])
    out.mkdir(parents=True, exist_ok=True)
    init = mcore_fsdp_adapter.FullyShardedDataParallel.__init__

    def traced(self, config, ddp_config, module, *args, **kwargs) -> None:
        specs = specs_from_model(list(module.named_parameters()),
                                 tp_size=parallel_state.get_tensor_model_parallel_world_size())
        init(self, config, ddp_config, module, *args, **kwargs)
        (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps({
            "specs": [spec.to_dict() for spec in specs],
            "buckets": [bucket.to_dict() for bucket in read_fsdp_buckets(self)],
            "dp_size": parallel_state.get_data_parallel_world_size(with_context_parallel=True),
            "expert_dp_size": parallel_state.get_expert_data_parallel_world_size(),
            "strategy": ddp_config.data_parallel_sharding_strategy, "bucket_size": ddp_config.bucket_size,
        }))

    mcore_fsdp_adapter.FullyShardedDataParallel.__init__ = traced
    _trace_optimizer_state(out)
    return pretrain_gpt.main()


def _trace_optimizer_state(out: Path) -> None:
    """Under ``--canzona``: after each step, each rank writes the optimizer state it holds by kind
    (``<dir>/state<r>.json``, measured from the tensors) beside the memory model's prediction for
    its coordinates (``megatron.canzona.planning.memory.fsdp_state_elements``, from the run's plan)."""
    import collections

    import torch

    from canzona_patches.integration import setup as setup_module
    from canzona_patches.integration.layout import is_expert_param
    from megatron.canzona.planning.memory import FIELD_KINDS, StateLayout, fsdp_state_elements
    from megatron.canzona.runtime.optimizer import CanzonaOptimizer

    made = {}
    setup_from_args = setup_module.setup_from_args

    def recorded_setup(model_chunks, ddp_config, args, **kwargs):
        made["setup"] = setup = setup_from_args(model_chunks, ddp_config, args, **kwargs)
        made["strategy"], made["bucket_size"] = ddp_config.data_parallel_sharding_strategy, ddp_config.bucket_size
        return setup

    setup_module.setup_from_args = recorded_setup
    run_step = CanzonaOptimizer._run_step

    def measured_step(self, factors) -> None:
        run_step(self, factors)
        held: collections.Counter[str] = collections.Counter()
        for stored in self.matrix_state.values():
            for piece in stored.get("pieces") or ():
                for name, value in (piece or {}).items():
                    if isinstance(value, torch.Tensor):
                        held[FIELD_KINDS[name]] += value.numel()
        for group in self.param_groups:
            for param in group["params"]:
                for name, value in self.state[param].items():
                    if name in ("momentum", "exp_avg", "exp_avg_sq"):  # a holder's momentum, AdamW's moments
                        held["momentum" if name == "momentum" else "adam_moments"] += value.numel()
        setup, (dp_rank, tp_rank) = made["setup"], self.engine.coord
        experts = any(is_expert_param(p.orig_param) for group in self.param_groups for p in group["params"])
        predicted = fsdp_state_elements(setup.plan, setup.specs, dp_rank=dp_rank, tp_rank=tp_rank,
                                        state=StateLayout.of(setup.config.optimizer, setup.config.matrix),
                                        strategy=made["strategy"], bucket_size=made["bucket_size"], experts=experts)
        name = f"state{torch.distributed.get_rank()}{'-experts' if experts else ''}.json"
        largest, step = self.engine.temporaries()
        (out / name).write_text(json.dumps({
            "measured": {kind: n for kind, n in held.items() if n}, "predicted": {k: n for k, n in predicted.items() if n},
            "momentum_on_holders": self.momentum_on_holders,
            "in_flight": {"largest": largest, "step": step, "early_gather": self.engine.early_temporaries()}}))

    CanzonaOptimizer._run_step = measured_step


if __name__ == "__main__":
    sys.exit(main())
