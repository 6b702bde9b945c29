"""Canzona: matrix-based optimizers (Muon, Shampoo, SOAP) inside Megatron-Core parallelism."""
