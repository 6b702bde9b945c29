"""End-to-end runs of pretrain_gpt.py and its tools (CPU, gloo)."""
