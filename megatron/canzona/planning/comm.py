"""Bytes each rank sends in one optimizer step, by collective, at the dtype on the wire.

Per rank (a (DP rank, TP rank) pair, Megatron's order: TP fastest), for every strategy:

* **reduce-scatter** of gradients and **all-gather** of parameters, bucket by bucket over
  the DP group: a ring sends (dp_size − 1)/dp_size of the padded bucket, at the gradient
  and the parameter dtype;
* **host groups** (Canzona): every rank holding a piece of a matrix (a DP shard of it, of
  each TP shard) that is not the matrix's host sends the piece to the host (fp32 main
  gradients, after clipping), and the host sends every such rank its piece of the fp32
  update back: each piece moves once each way. A whole matrix's Muon direction iterated in
  bf16 goes back in bf16 (:func:`narrow_update_bytes`);
* **synchronous compute** (stock ZeRO-1 and Megatron's layer-wise optimizer under TP, both
  as Megatron's ``muon_tp_mode duplicated``): every rank holding a piece needs the whole
  matrix, so it sends its piece to every other holder.

Messages (for the α-β objective of the planner) count one per (matrix, peer) pair of the
host groups and one per ring step of a bucket collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

from .cost import CostModel
from .plan import BufferPlan
from .schedule import Task
from .specs import ParamSpec

FP32_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class WireConfig:
    """Bytes per element of what crosses the network, and the latency of one message."""

    param_bytes: int = 2
    """Parameter all-gather: the model's dtype (bf16)."""
    grad_bytes: int = 2
    """Gradient reduce-scatter: the gradient buffer's dtype (bf16; fp32 with
    ``--grad-reduce-in-fp32``)."""
    main_grad_bytes: int = FP32_BYTES
    """Host-group gather: the fp32 main gradients, clipped (exact, unlike the buffer dtype)."""
    update_bytes: int = FP32_BYTES
    """Host-group scatter: fp32 update directions (applied to fp32 main parameters)."""
    latency_bytes: int = 1 << 19
    """A message costs as long as sending this many bytes (~10 µs at 50 GB/s); used only by
    the planner's objective, never in reported byte counts."""

    def __post_init__(self) -> None:
        for name in ("param_bytes", "grad_bytes", "main_grad_bytes", "update_bytes"):
            if getattr(self, name) not in (1, 2, 4, 8):
                raise ValueError(f"WireConfig.{name}={getattr(self, name)} is not a dtype size (1, 2, 4 or 8)")
        if self.latency_bytes < 0:
            raise ValueError(f"WireConfig.latency_bytes must be >= 0, got {self.latency_bytes}")


@dataclass
class RankTraffic:
    """What one rank sends in one step: bytes by kind (each says when it moves and over which
    group), and the collective calls."""

    reduce_scatter: float = 0.0
    """Gradient reduce-scatter: Megatron's DDP over the DP group (across nodes once DP spans
    them), overlapped with backward."""
    all_gather: float = 0.0
    """Parameter all-gather: Megatron's DDP over the DP group, overlapped with the next
    forward (``--overlap-param-gather``)."""
    host_gather: float = 0.0
    """Pieces of matrices split across ranks, sent to their host ranks (``--canzona-tp-mode
    async``): over the TP group (and DP only for the lean layout's split matrices), in
    backward when the gathers go early, else at the step's start."""
    host_scatter: float = 0.0
    """Updates a host sends back to the holders of its matrices' pieces: the gather's groups,
    in the step, after the host's compute."""
    sync_gather: float = 0.0
    """Pieces every holder gathers (``--canzona-tp-mode sync``): over the TP group, in the
    step."""
    tp_gram: float = 0.0
    """Gram matrices of the matrices its TP ranks compute together (``--canzona-tp-together``),
    all-reduced over the TP group in :data:`GRAM_REDUCE_BYTES` per element, with the compute
    (in backward's tail with early compute, else in the step)."""
    messages: int = 0
    """Point-to-point messages and collective rounds, for the latency term."""

    def as_dict(self) -> dict[str, float]:
        """Bytes by kind."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "messages"}

    @property
    def total(self) -> float:
        return sum(self.as_dict().values())


def rank_index(dp_rank: int, tp_rank: int, tp_size: int) -> int:
    return dp_rank * tp_size + tp_rank


def traffic(
    buffers: Iterable[BufferPlan], tasks: Iterable[Task], *, dp_size: int, tp_size: int, wire: WireConfig,
    narrow: Mapping[str, int] | None = None, grams: Mapping[str, Sequence[tuple[int, int]]] | None = None,
    gathers: Mapping[str, int] | None = None,
) -> list[RankTraffic]:
    """Bytes sent per rank (index ``dp_rank * tp_size + tp_rank``) in one step, for the
    buckets of ``buffers`` and the schedule's ``tasks`` (:mod:`.schedule`); ``narrow``: the
    tasks whose update goes back narrower (:func:`narrow_update_bytes`); ``grams``: per task its
    TP ranks compute together, ``(all-reduces, elements of each)`` of its Gram matrices
    (:meth:`~.cost.CostModel.shared_reductions`); ``gathers``: the tasks whose pieces go to their
    host narrower (:func:`narrow_gather_bytes`)."""
    out = [RankTraffic() for _ in range(dp_size * tp_size)]
    rs, ag, messages = collective_bytes(buffers, dp_size, wire)
    for rank in out:
        rank.reduce_scatter, rank.all_gather, rank.messages = rs, ag, messages
    for task in tasks:
        add_task_traffic(out, task, tp_size, wire, (narrow or {}).get(task.key), (gathers or {}).get(task.key))
        if task.together and task.host is not None:  # a ring reduce-scatter and all-gather per all-reduce
            if grams is None:
                raise ValueError(f"{task.key} is computed by its TP ranks together: pass its Gram matrices (grams=)")
            host = out[rank_index(*task.host, tp_size)]
            for count, elements in grams[task.key]:
                host.tp_gram += count * 2 * (tp_size - 1) / tp_size * elements * GRAM_REDUCE_BYTES
                host.messages += count * 2 * (tp_size - 1)
    return out


GRAM_REDUCE_BYTES = 4
"""Bytes per element of the Gram matrices the TP ranks of a matrix computed together sum
(:func:`~megatron.canzona.optim.newton_schulz.newton_schulz_sharded` reduces in fp32)."""


def shared_grams(tasks: Iterable[Task], specs: Iterable[ParamSpec], cost_model: CostModel) -> dict[str, list[tuple[int, int]]]:
    """Task key -> ``(all-reduces, elements of each)`` of the tasks computed together (:func:`traffic`'s ``grams``)."""
    by_name = {(s.chunk, s.name): s for s in specs}
    return {t.key: cost_model.shared_reductions(by_name[(t.chunk, t.name)]) for t in tasks if t.together}


NARROW_DTYPE_BYTES = {"bfloat16": 2, "float16": 2}
"""Newton-Schulz dtypes narrower than the fp32 update, by their size."""


def narrow_bytes(cost_model: CostModel, spec: ParamSpec, part: int) -> int | None:
    """Bytes per element of the update of ``spec``'s ``part`` on the wire when narrower than
    fp32, else ``None``: Muon iterating Newton-Schulz in bf16 gives a whole matrix's direction
    exactly in bf16 before its shape scale, so the host sends that and the holders scale it
    (``megatron.canzona.runtime.optimizer.narrow_updates``); a part of several matrices (a
    split QKV) has a scale each and goes in fp32."""
    size = NARROW_DTYPE_BYTES.get(cost_model.ns_dtype) if cost_model.kind == "muon" else None
    return size if size is not None and len(spec.part_matrices(part)) == 1 else None


def narrow_update_bytes(tasks: Iterable[Task], specs: Iterable[ParamSpec], cost_model: CostModel) -> dict[str, int]:
    """Task key -> bytes per element of its update on the wire, for the tasks whose update is
    narrower than fp32 (:func:`narrow_bytes`) and that have one host (async) and move."""
    by_name = {(s.chunk, s.name): s for s in specs}
    return {t.key: size for t in tasks if t.host is not None and not t.is_local()
            and (size := narrow_bytes(cost_model, by_name[(t.chunk, t.name)], t.part)) is not None}


def narrow_gather_bytes(tasks: Iterable[Task], specs: Iterable[ParamSpec], cost_model: CostModel) -> dict[str, int]:
    """Task key -> bytes per element of its pieces on the way to its host under
    ``--canzona-narrow-gathers`` (Muon's input normalised by its holders,
    ``megatron.canzona.runtime.optimizer.narrow_gathers``): the narrow-update tasks
    (:func:`narrow_update_bytes`) but those their TP ranks compute together."""
    tasks = list(tasks)
    narrow = narrow_update_bytes(tasks, specs, cost_model)
    return {t.key: narrow[t.key] for t in tasks if t.key in narrow and not t.together}


def _packed(numel: int, narrow: int | None, word: int) -> int:
    """Bytes of a piece of ``numel`` elements on the wire: ``word`` each, or ``narrow`` each
    rounded up to whole words (as the engine packs a narrow segment)."""
    return numel * word if narrow is None else -(-numel * narrow // word) * word


def collective_bytes(buffers: Iterable[BufferPlan], dp_size: int, wire: WireConfig) -> tuple[float, float, int]:
    """(reduce-scatter bytes, all-gather bytes, messages) one rank sends for ``buffers``."""
    numel = sum(b.end - b.start for buffer in buffers for b in buffer.buckets)
    count = sum(len(buffer.buckets) for buffer in buffers) if dp_size > 1 else 0
    fraction = (dp_size - 1) / dp_size
    return fraction * numel * wire.grad_bytes, fraction * numel * wire.param_bytes, 2 * (dp_size - 1) * count


def add_task_traffic(out: list[RankTraffic], task: Task, tp_size: int, wire: WireConfig,
                     update_bytes: int | None = None, gather_bytes: int | None = None) -> None:
    """One task's bytes; ``update_bytes`` and ``gather_bytes``: its update's and its pieces' on the
    wire when narrower (each piece then rounded up to whole fp32 words, as the runtime packs it)."""
    holders = [(coord, hi - lo) for coord, lo, hi in task.holders(tp_size)]
    if task.host is None:  # every holder gathers every other holder's piece
        for coord, n in holders:
            peers = len(holders) - 1
            rank = out[rank_index(*coord, tp_size)]
            rank.sync_gather += peers * n * wire.main_grad_bytes
            rank.messages += peers
        return
    host = out[rank_index(*task.host, tp_size)]
    for coord, n in holders:
        if coord == task.host:
            continue
        holder = out[rank_index(*coord, tp_size)]
        holder.host_gather += _packed(n, gather_bytes, wire.main_grad_bytes)
        holder.messages += 1
        host.host_scatter += _packed(n, update_bytes, wire.update_bytes)
        host.messages += 1
