"""Fixes for Megatron-Core 0.19.2 bugs that stop its own baselines from running.

Canzona is compared against Megatron's layer-wise Muon (``--optimizer muon
--use-distributed-optimizer``); these fixes let that baseline run in the configurations
the comparisons need, without changing its math.

* ``LayerWiseDistributedOptimizer.__init__`` (megatron/core/optimizer/layer_wise_optimizer.py):
  without ``bf16`` its children are raw torch optimizers with no ``config``, so it takes
  ``config=None`` from them, and ``get_megatron_optimizer`` then fails the
  ``ChainedOptimizer`` check that every chained optimizer shares one config (fp32 Muon
  with AdamW for the embeddings cannot be built), and its step calls ``prepare_grads`` on
  those raw optimizers, which have none. The fix sets the config it was given and, as its
  bf16 path wraps each child in ``Float16OptimizerWithFloat16Params``, wraps each fp32
  child in Megatron's ``FP32Optimizer``.
"""

from __future__ import annotations

import functools

from canzona_patches.version import require_pinned_megatron

require_pinned_megatron()

from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer  # noqa: E402
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer  # noqa: E402

_MARK = "__canzona_fixed__"


def fix_fp32_layer_wise_config() -> None:
    """Let fp32 ``LayerWiseDistributedOptimizer`` chain with the distributed optimizer; idempotent."""
    init = LayerWiseDistributedOptimizer.__init__
    if getattr(init, _MARK, False):
        return

    @functools.wraps(init)
    def init_keeping_config(self, optimizers, config, *args, init_state_fn_list=None, **kwargs):
        init(self, optimizers, config, *args, init_state_fn_list=init_state_fn_list, **kwargs)
        self.config = config
        if not (config.bf16 or config.fp16):
            fns = init_state_fn_list or [None] * len(self.chained_optimizers)
            self.chained_optimizers = [
                opt if isinstance(opt, MegatronOptimizer) else FP32Optimizer(opt, config, fn)
                for opt, fn in zip(self.chained_optimizers, fns)
            ]

    setattr(init_keeping_config, _MARK, True)
    LayerWiseDistributedOptimizer.__init__ = init_keeping_config


def apply_all() -> None:
    """Every fix in this module."""
    fix_fp32_layer_wise_config()
