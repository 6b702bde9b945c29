"""Runtime: the only Canzona code that calls torch.distributed or touches streams."""

from megatron.canzona.runtime.launcher import LaunchConfig, RankError, launch

__all__ = ["LaunchConfig", "RankError", "launch"]
