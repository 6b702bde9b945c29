"""What QK-clip (``--qk-clip`` under ``--canzona``) costs per iteration, projected on a cluster.

Per iteration and rank (canzona_patches/integration/qk_clip.py does this):

* **One all-reduce (max)** of the rank's ``(layers, heads)`` maxima, fp32, over its DP x CP group:
  ``4 * layers/PP * heads/TP`` bytes. Priced two ways: as the simulator prices an all-reduce (a
  ring reduce-scatter and all-gather, ``2 (p - 1)`` latency steps, over the inter-node link when
  the group spans nodes: its ranks are TP apart), and as a tree, ``2 ceil(log2 p)`` steps, which
  is what NCCL runs for a message this small. The truth lies between; both are printed.
* **The clip**: each rank reads and writes the fp32 rows of the ``linear_qkv`` main weights it
  holds (8 bytes an element); with the whole layout's balance, at most
  ``ceil(layers / (dp * cp))`` matrices of ``(heads + 2 groups) * head_dim / tp`` rows per rank.
* **No host sync**: the factors are applied as tensors (1 where nothing exceeds the threshold);
  the logged value is read at log iterations only.

``python -m megatron.canzona.planning.sim.qk_clip --model qwen3-32b --tp 8 --dp 32 --cluster h100-ib400``
prints one line.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from ..qwen3 import QWEN3_MODELS, get_qwen3_config
from .cluster import ClusterSpec, load_cluster, presets
from .network import ring_seconds


@dataclass(frozen=True)
class QKClipCost:
    """One iteration's QK-clip on one rank."""

    table_bytes: int
    ranks: int
    ring_s: float
    tree_s: float
    clip_bytes: int
    clip_s: float
    host_syncs: int = 0


def qk_clip_cost(model: str, *, tp: int, dp: int, pp: int = 1, cp: int = 1, cluster: ClusterSpec) -> QKClipCost:
    """The cost of QK-clip per iteration on the most loaded rank (module docstring)."""
    cfg = get_qwen3_config(model)
    ranks = dp * cp
    layers = math.ceil(cfg.num_layers / pp)
    table = 4 * layers * cfg.num_attention_heads // tp
    link = cluster.link(tp * ranks > cluster.gpus_per_node)
    ring = 2 * ring_seconds(table, ranks, link, cluster.collectives.ring_efficiency)
    tree = 0.0 if ranks == 1 else 2 * math.ceil(math.log2(ranks)) * link.latency_s + 2 * table / link.bytes_per_s
    rows = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels // tp
    matrices = math.ceil(layers / ranks)
    clip_bytes = 8 * matrices * rows * cfg.hidden_size
    return QKClipCost(table_bytes=table, ranks=ranks, ring_s=ring, tree_s=tree, clip_bytes=clip_bytes,
                      clip_s=clip_bytes / cluster.gpu.memory_bytes_per_s)


def describe(cost: QKClipCost) -> str:
    return (f"QK-clip per iteration: all-reduce of {cost.table_bytes / 1024:.1f} KiB over DP x CP {cost.ranks} "
            f"(ring {cost.ring_s * 1e3:.3f} ms, tree {cost.tree_s * 1e3:.3f} ms), clip "
            f"{cost.clip_bytes / 2**20:.1f} MiB of fp32 rows read and written ({cost.clip_s * 1e3:.3f} ms), "
            f"{cost.host_syncs} host syncs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-32b", choices=sorted(QWEN3_MODELS))
    for name in ("tp", "dp", "pp", "cp"):
        parser.add_argument(f"--{name}", type=int, default=8 if name == "tp" else 32 if name == "dp" else 1)
    parser.add_argument("--cluster", default="h100-ib400", help=f"a preset ({', '.join(presets())}) or a file")
    args = parser.parse_args(argv)
    for name in ("tp", "dp", "pp", "cp"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    cost = qk_clip_cost(args.model, tp=args.tp, dp=args.dp, pp=args.pp, cp=args.cp, cluster=load_cluster(args.cluster))
    print(describe(cost))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
