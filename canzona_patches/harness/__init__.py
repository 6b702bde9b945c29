"""A tiny Qwen3-like GPT trained through Megatron-Core on CPU/gloo ranks: the harness the
multi-rank tests and the benchmark tools share (:mod:`.tiny_gpt`, :mod:`.tiny_checkpoint`),
a counter of host synchronisations (:mod:`.host_syncs`) and checkpoint faults (:mod:`.faults`)."""
