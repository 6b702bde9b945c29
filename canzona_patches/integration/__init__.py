"""``--canzona`` inside Megatron-Core: the flags, the layouts handed to DDP, the bucket shards of
variable size, the optimizer that steps them, the early gathers and the training-loop hooks."""
