#!/usr/bin/env python
"""``pretrain_gpt.py`` recording Megatron-FSDP's geometry: each rank writes, once its model chunk is
wrapped, the planner's descriptions of the chunk's parameters (taken before Megatron-FSDP shards
them) and the buckets read from the buffers Megatron-FSDP built (``<dir>/rank<r>.json``). Launch it
in place of the entry point with ``FSDP_GEOMETRY_TRACE=<dir>``; tests/e2e/test_megatron_fsdp.py
predicts the buckets from the descriptions and compares."""

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
            "strategy": ddp_config.data_parallel_sharding_strategy, "bucket_size": ddp_config.bucket_size,
        }))

    mcore_fsdp_adapter.FullyShardedDataParallel.__init__ = traced
    return pretrain_gpt.main()


if __name__ == "__main__":
    sys.exit(main())
