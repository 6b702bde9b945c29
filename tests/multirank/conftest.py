"""Rank launches of this directory fork from one process that imported Megatron once.

``launch`` starts ranks with ``spawn`` by default: each rank is a new interpreter importing torch
and Megatron-Core (3 to 5 s of CPU each). The modules below are imported once per test session
by multiprocessing's fork server, and every rank of every launch is forked from it
(``megatron.canzona.runtime.launcher.PRELOAD_ENV``); what a rank computes is unchanged.
``CANZONA_LAUNCH_PRELOAD=`` (empty) in the environment runs the old way.
"""

import os

from megatron.canzona.runtime.launcher import PRELOAD_ENV

PRELOAD = (
    "torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state", "megatron.core.models.gpt",
    "megatron.core.optimizer", "megatron.core.distributed", "megatron.training", "megatron.training.training",
    "psutil", "canzona_patches.harness.tiny_gpt", "canzona_patches.harness.tiny_checkpoint",
    "canzona_patches.harness.host_syncs", "canzona_patches.emulation.cpu", "canzona_patches.registry",
    "canzona_patches.integration.optimizer", "canzona_patches.integration.setup", "canzona_patches.integration.layout",
    "canzona_patches.integration.qk_clip", "canzona_patches.checkpoints.state",
)
"""What the harnesses' rank bodies import, lazily or not (Megatron's training loop among them)."""
os.environ.setdefault(PRELOAD_ENV, ",".join(PRELOAD))
