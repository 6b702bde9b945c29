"""Canzona's optimizer state in Megatron's distributed checkpoints (:mod:`.state`: sharded
state dicts that reshard across TP, DP and layouts) and the files that hold them
(:mod:`.files`: staged, verified saves, and saving on CPU)."""
