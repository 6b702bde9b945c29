"""α-β costs of the collectives on a cluster: rings and all-to-alls between stage ranks.

Ranks are numbered inside one pipeline stage as Megatron-Core does (``dp_rank * tp_size +
tp_rank``, TP fastest) and fill nodes in order: rank r is on node ``r // gpus_per_node``.

* A ring reduce-scatter or all-gather of a buffer of S bytes over p ranks moves
  (p − 1)/p · S per rank in p − 1 steps: ``(p − 1)·α + (p − 1)/p · S / (B·ring_efficiency)``,
  with the inter-node link's α and B when the group spans nodes (every ring then crosses
  the slower link); an all-reduce is a reduce-scatter then an all-gather.
* A bucket whose DP shards differ in size (the whole layout) is reduce-scattered and
  all-gathered as torch's ProcessGroupNCCL runs unequal list-form collectives: one NCCL group
  of ``ncclReduce`` (``ncclBroadcast``) calls, one per rank whose shard is not empty, each a
  ring pass of that shard (a reduce moves its whole shard through every rank). The calls of
  a group run in order on each rank, a rank starting the next as soon as it has passed the
  last one on, so they pipeline around the ring: the ring fills once and each further call
  adds one step, ``(p − 1 + k − 1)·α + Σ shard / (B·ring_efficiency)`` for k non-empty
  shards (against ``(p − 1)·α + (p − 1)/p · S / (B·ring_efficiency)`` for equal shards). This
  is an assumption about NCCL's grouped kernels, not a measurement: calls run one after
  another would pay ``k·(p − 1)·α`` (:func:`grouped_ring_seconds` with ``pipelined=False``).
* An all-to-all (a fused exchange of uneven pieces) ends when its slowest rank does: rank
  r needs ``α + max(out_r, in_r) / (B·alltoall_efficiency)`` per link, intra-node and
  inter-node bytes each on their own link (the slower of the two counts), α of the slowest
  link it uses. No bytes anywhere: no collective, no time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .cluster import ClusterSpec, LinkSpec


def ring_seconds(nbytes: float, group_size: int, link: LinkSpec, efficiency: float) -> float:
    """One ring reduce-scatter (or all-gather) of an ``nbytes`` buffer over ``group_size`` ranks."""
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    steps = group_size - 1
    return steps * link.latency_s + steps / group_size * nbytes / (link.bytes_per_s * efficiency)


def grouped_ring_seconds(shard_bytes: Sequence[float], link: LinkSpec, efficiency: float,
                         pipelined: bool = True) -> float:
    """One group of ring reduces (or broadcasts), one per non-empty entry of ``shard_bytes``
    (a byte count per rank of the group), as NCCL runs an unequal reduce-scatter (all-gather)
    (module docstring)."""
    p = len(shard_bytes)
    sizes = [b for b in shard_bytes if b > 0]
    if p <= 1 or not sizes:
        return 0.0
    steps = (p - 1 + len(sizes) - 1) if pipelined else len(sizes) * (p - 1)
    return steps * link.latency_s + sum(sizes) / (link.bytes_per_s * efficiency)


@dataclass
class Flows:
    """Bytes each rank sends to and receives from ranks of its node and of other nodes."""

    out_intra: dict[int, float] = field(default_factory=dict)
    out_inter: dict[int, float] = field(default_factory=dict)
    in_intra: dict[int, float] = field(default_factory=dict)
    in_inter: dict[int, float] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.out_intra or self.out_inter)

    def sent(self, rank: int) -> float:
        return self.out_intra.get(rank, 0.0) + self.out_inter.get(rank, 0.0)


class Topology:
    """Where the ranks of a stage sit, and what the collectives between them cost."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster

    def node(self, rank: int) -> int:
        return rank // self.cluster.gpus_per_node

    def spans_nodes(self, ranks: Iterable[int]) -> bool:
        return len({self.node(r) for r in ranks}) > 1

    def ring(self, nbytes: float, members: Sequence[int]) -> float:
        """A reduce-scatter or all-gather of an ``nbytes`` buffer over ``members``."""
        if len(members) <= 1 or nbytes <= 0:
            return 0.0
        link = self.cluster.link(self.spans_nodes(members))
        return ring_seconds(nbytes, len(members), link, self.cluster.collectives.ring_efficiency)

    def grouped(self, shard_bytes: Sequence[float], members: Sequence[int]) -> float:
        """An unequal reduce-scatter or all-gather over ``members``, rank i's shard holding
        ``shard_bytes[i]`` bytes (:func:`grouped_ring_seconds`)."""
        if len(members) <= 1:
            return 0.0
        link = self.cluster.link(self.spans_nodes(members))
        return grouped_ring_seconds(shard_bytes, link, self.cluster.collectives.ring_efficiency)

    def flows(self, transfers: Iterable[tuple[int, int, float]]) -> Flows:
        """Sum ``(src, dst, bytes)`` transfers per rank and link (a rank's own bytes stay put)."""
        out = Flows()
        for src, dst, nbytes in transfers:
            if src == dst or nbytes <= 0:
                continue
            inter = self.node(src) != self.node(dst)
            sent, got = (out.out_inter, out.in_inter) if inter else (out.out_intra, out.in_intra)
            sent[src] = sent.get(src, 0.0) + nbytes
            got[dst] = got.get(dst, 0.0) + nbytes
        return out

    def inter_node_seconds(self, flows: Flows) -> dict[int, float]:
        """Per rank, the seconds ``flows`` hold its inter-node link (out or in, the larger)."""
        bandwidth = self.cluster.link(True).bytes_per_s * self.cluster.collectives.alltoall_efficiency
        ranks = set(flows.out_inter) | set(flows.in_inter)
        return {r: max(flows.out_inter.get(r, 0.0), flows.in_inter.get(r, 0.0)) / bandwidth for r in ranks}

    def alltoall(self, flows: Flows) -> float:
        """Duration of one fused all-to-all moving ``flows`` (0 when nothing moves)."""
        if flows.empty:
            return 0.0
        efficiency = self.cluster.collectives.alltoall_efficiency
        ranks = set(flows.out_intra) | set(flows.in_intra) | set(flows.out_inter) | set(flows.in_inter)
        slowest = 0.0
        for r in ranks:
            intra = max(flows.out_intra.get(r, 0.0), flows.in_intra.get(r, 0.0))
            inter = max(flows.out_inter.get(r, 0.0), flows.in_inter.get(r, 0.0))
            time, latency = 0.0, 0.0
            if intra:
                link = self.cluster.intra_node
                time, latency = intra / (link.bytes_per_s * efficiency), link.latency_s
            if inter:
                link = self.cluster.link(True)
                time, latency = max(time, inter / (link.bytes_per_s * efficiency)), max(latency, link.latency_s)
            slowest = max(slowest, latency + time)
        return slowest
