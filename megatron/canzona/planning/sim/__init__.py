"""Simulate one training iteration per rank from the plans the runtime executes (pure).

Interface (stable; new fields only get defaults, old names keep working)
-------------------------------------------------------------------------

    from megatron.canzona.planning.sim import ClusterSpec, Workload, load_cluster, load_calibration, simulate

    cluster = load_cluster("h100-ib400")  # a preset (clusters/), a TOML/JSON file, or ClusterSpec.from_dict({...})
    result = simulate(
        specs,                      # list[ParamSpec] of one pipeline stage (qwen3_specs(...) or any model)
        strategy="canzona",         # see STRATEGIES below
        cluster=cluster,
        dp_size=32, tp_size=8,      # ep_size=1, expert_tp_size=1, pp_size=1
        optimizer="muon",           # muon | shampoo | soap (the FLOP formula when no calibration)
        calibration=None,           # Calibration: measured seconds per (m, n) replace the formulas
        workload=Workload(global_batch=128, micro_batch=1, seq_length=4096),  # None: no forward/backward
                                    # (the bucket collectives are then wholly exposed)
        plan=None,                  # precomputed CanzonaPlan (canzona*) or DPPlan (megatron_layerwise,
                                    # layer_sharded: required, made by canzona_patches.integration.layerwise_baseline)
        expert_plan=None,           # the layer-wise DPPlan of the expert buffers (MoE, those two strategies)
        wire=None,                  # WireConfig: bytes per element on the wire (recipes: fp32 gradients)
        overlap=True,               # False: Canzona's micro-groups run gather, compute, scatter serially
        early_compute=False,        # Canzona computes each micro-group before the step once gathered, in the
                                    # reduce-scatters' tail after backward (never beside its GEMMs)
        clip_rate=0.0,              # with early_compute: the chance the clip acts in an iteration, priced as the
                                    # runtime's speculation policy decides (details["speculation"])
    )                               # -> StrategyResult
    result.optimizer_step_seconds, result.iteration_seconds, result.exposed_comm_seconds, result.to_dict()

``StrategyResult`` also has ``param_gather_seconds`` and ``grad_reduce_seconds`` (whole
durations of the bucket collectives, hidden or not): ``tools/bench_step.py`` times
``optimizer.step()`` without ``overlap_param_gather``, i.e. about
``optimizer_step_seconds + param_gather_seconds`` (``sync``: no all-gather).

Strategies (:data:`STRATEGIES`):

* ``canzona`` -- the Canzona plan (``plan``, else the whole layout: variable-size DP
  shards, every matrix whole on one DP rank, uneven bucket collectives); one host per
  matrix; micro-groups pipelined as ``_StepRun.run_async`` (gather k+1 | compute k |
  scatter k | apply k-1); the dense micro-groups' gathers issued before the step as their
  buckets reduce (``canzona_patches.integration.early_gather``: on ``nccl`` when each reduce-scatter
  completes, in backward; on ``gloo`` once backward ends), one at a time on their own
  stream, beside the reduce-scatters;
* ``canzona_lean`` -- the same with the lean layout (Megatron's equal shards; a matrix across
  a shard boundary is gathered to its host in the step);
* ``canzona_tp_sync`` -- the same layout, ``--canzona-tp-mode sync`` (the recipes'
  ``VARIANT=sync``, bench_step's ``sync`` at TP > 1): every holder gathers and computes;
* ``sync`` -- synchronous compute (Moonlight): gradients all-reduced over DP, every DP rank
  and every TP rank computes every matrix whole (bench_step's ``sync`` at TP 1);
* ``megatron_layerwise`` -- Megatron-Core's layer-wise layout, ``muon_tp_mode duplicated``:
  one blocking TP all-gather per matrix, then every TP rank computes it;
* ``megatron_tp_blockwise`` -- the same layout under Megatron's default ``muon_tp_mode
  blockwise``: each TP rank orthogonalises its own slice of a TP-sharded matrix alone (another
  optimizer than the whole matrix's), nothing gathered; Muon only;
* ``megatron_tp_distributed`` -- the same layout, ``muon_tp_mode distributed``: the TP ranks of
  a TP-sharded matrix orthogonalise it together, each on its slice, an all-reduce of the Gram
  matrix per Newton-Schulz step (:func:`~megatron.canzona.planning.cost.sharded_ns_flops`); Muon only;
* ``layer_sharded`` -- the same layout, one home TP rank per matrix, one blocking fused
  all-to-all each way, no overlap (Megatron-LM's proposed ``--muon-tp-mode layer_sharded``);
* ``megatron_main`` -- Megatron-LM main's layer-wise layout (after 0.19.2; modelled in
  :mod:`~megatron.canzona.planning.megatron_main`): buckets padded to equal shards, padding
  floor 0.9, Newton-Schulz cost balanced across buckets, ``muon_tp_mode duplicated``;
* ``zero1`` -- stock ZeRO-1 equal chunks; a matrix cut by a DP shard boundary or by TP is
  gathered and computed by every rank holding a piece;
* ``adamw`` -- AdamW on every parameter with the stock distributed optimizer.

Cluster schema (TOML or JSON; every number must be positive; ``[inter_node]`` may be left
out when one node holds every rank)::

    name = "h100-ib400"
    gpus_per_node = 8            # ranks per node (72 for NVL72; a CPU "node": its processes)
    compute_slots = 8            # optional: ranks of a node that compute at once (default gpus_per_node;
                                 # a CPU box with fewer cores than ranks: its core count)
    backend = "nccl"             # optional: "nccl" (default) or "gloo" (CPU: Canzona's host-group
                                 # gathers go when backward ends, not as each bucket is reduced)
    [gpu]
    bf16_tflops = 989.4          # dense bf16 matmul peak, TFLOP/s
    fp32_tflops = 66.9           # fp32 matmul peak, TFLOP/s
    memory_gb_per_s = 3350       # memory bandwidth, GB/s
    matmul_efficiency = 0.6      # fraction of the peak the optimizer's matmuls reach
    memory_efficiency = 0.8      # fraction of the bandwidth elementwise kernels reach
    optimizer_dtype = "bf16"     # "bf16" or "fp32": the peak the optimizer's matmuls run at
    [training]
    mfu = 0.40                   # model FLOPs utilization of forward and backward
    [intra_node]                 # NVLink (or shared memory / loopback for a CPU node)
    bandwidth_gb_per_s = 450     # per GPU, per direction
    latency_us = 3.0             # per message / ring step
    [inter_node]                 # InfiniBand / Ethernet
    bandwidth_gb_per_s = 50      # per GPU, per direction
    latency_us = 8.0
    [collectives]
    ring_efficiency = 0.85       # reduce-scatter / all-gather bus bandwidth over link bandwidth
    alltoall_efficiency = 0.7    # all-to-all bandwidth over link bandwidth

Cost model (:mod:`.network`, :mod:`.step`, :mod:`.iteration`): a ring reduce-scatter or
all-gather of S bytes over p ranks takes ``(p-1)·α + (p-1)/p · S / (B·ring_efficiency)``,
B and α being the inter-node link's if the group spans nodes; an all-to-all takes, over
its ranks, the largest ``α + max(bytes out, bytes in) / (B·alltoall_efficiency)`` (intra-
and inter-node bytes on their own links, the slower one counting). A matrix update takes
its FLOPs over ``peak · matmul_efficiency`` plus its momentum's 12 bytes per element over
the memory bandwidth, or the calibrated seconds; applying an update 14 bytes per element;
AdamW 30 bytes per element.
"""

from .cluster import ClusterSpec, CollectiveSpec, GPUSpec, LinkSpec, load_calibration, load_cluster, presets
from .result import Segment, StrategyResult
from .simulate import STRATEGIES, Workload, simulate

__all__ = [
    "STRATEGIES", "ClusterSpec", "CollectiveSpec", "GPUSpec", "LinkSpec", "Segment", "StrategyResult", "Workload",
    "load_calibration", "load_cluster", "presets", "simulate",
]
