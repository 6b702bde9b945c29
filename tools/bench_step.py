#!/usr/bin/env python
"""Optimizer-step time of Canzona against synchronous compute and Megatron's layer-wise Muon.

    python tools/bench_step.py                          # DP 2 on gloo, one thread per rank
    python tools/bench_step.py --dp 4 --layers 4 --hidden 512 --steps 8 --rounds 4 --json step.json
    python tools/bench_step.py --tp 2 --dp 1 --gantt step_tp2.png    # tensor parallelism
    python tools/bench_step.py --moe --dp 4 --ep 2 --layers 2 --hidden 256   # mixture of experts
    python tools/bench_step.py --iteration --bucket-size 1000000   # exposed optimizer time per iteration
    python tools/bench_step.py --fsdp optim_grads_params --dp 4   # under Megatron-FSDP, against its AdamW
    python tools/bench_step.py --fsdp optim_grads_params --iteration --narrow-gathers   # whole FSDP iterations

Every variant trains the same Qwen3-like GPT (QK-norm, SwiGLU, GQA) with Megatron-Core's
DDP on gloo, one process and one torch thread per DP rank, and times ``optimizer.step()``
(after a barrier) on every rank; a step's time is the slowest rank's. Variants:

* ``canzona`` -- ``--optimizer muon --canzona --canzona-layout whole``: every matrix whole in
  one DP rank's shard (variable-size shards, uneven bucket collectives), its Muon run once by
  its host, then the parameter all-gather;
* ``canzona_lean`` -- the same with ``--canzona-layout lean``: equal shards, a matrix across a
  shard boundary (``--bucket-size`` below its size) gathered to its host first;
* ``sync`` -- synchronous compute: gradients all-reduced, every rank runs Muon on every
  matrix (the same math, no distributed optimizer);
* ``megatron`` -- Megatron-Core's own ``LayerWiseDistributedOptimizer`` Muon configured to
  the same math (fp32 Newton-Schulz, quintic coefficients, spectral scale, split QKV).

With ``--tp 2`` (or more) the variants are ``canzona`` (async: each matrix computed once on
a host TP rank, fused all-to-alls in pipelined micro-groups), ``sync`` (``--canzona-tp-mode
sync``: every TP rank gathers and computes every matrix) and ``megatron`` (``muon_tp_mode
duplicated``, Megatron's exact-math TP mode: every TP rank all-gathers and computes). Bytes
per step and rank on the TP group are measured for Canzona's two modes and computed from the
shapes for Megatron's all-gathers (at TP 1, Canzona's host-group bytes: non-zero only for
matrices split across DP shards). ``--gantt FILE.png`` draws one async step per rank.

``--iteration`` times whole iterations instead (``zero_grad`` -> forward/backward with
``--overlap-grad-reduce`` -> step -> the next forward, ``--overlap-param-gather`` for the
distributed optimizers and Megatron's layer-wise one, as ``pretrain_gpt.py`` runs them): per iteration, the exposed optimizer time from the end of backward
(the embedding's gradient) to the next forward's first transformer layer, which holds the
gradient reduce-scatter's tail, clipping, the step and any parameter all-gather not hidden.

Prints the median step time of each variant, its ratios to ``sync`` and to ``megatron``,
the ideal ``canzona / sync`` (1/DP for a dense model at TP 1), the matrices each rank
computes per step, and a JSON object with the configuration, git revision and machine
(``--json FILE`` to also write it), which also keeps every timed step of every round
(``round_step_ms``: the variants take turns round by round, so the k-th rounds of two
variants ran minutes apart at most, and their difference survives the machine's drift).
Ratios from one run only: the machine is shared and absolute times drift between runs.

``--fsdp STRATEGY`` runs under Megatron-FSDP instead: Canzona's Muon over its shards against
Megatron's own AdamW under FSDP (the step times and their ratio), and each rank's host-group bytes
as measured beside the plan's; it exits 1 where they differ. ``--fsdp STRATEGY --iteration`` times
whole iterations under Megatron-FSDP instead (its reduce-scatters and all-gathers overlapped, as
``pretrain_gpt.py`` runs it): Megatron's AdamW, Canzona as ``pretrain_gpt.py --canzona`` runs it
(each micro-group gathered as its buckets reduce, the holders preparing each bucket's pieces then),
the same with ``--canzona-no-early-gather`` (everything in the step), the gather-to-every-holder
peer at TP 1 and, with ``--narrow-gathers``, Canzona's bf16 gathers (each bucket's share of the exact
norm taken as it reduces); each iteration in its parts and against AdamW's, round by round.

``--moe`` replaces every layer's MLP by ``--num-experts`` SwiGLU experts (top ``--moe-topk``,
all-to-all dispatch, auxiliary load-balancing loss) over ``--ep`` expert-parallel ranks,
expert TP 1 (sequence parallelism with ``--tp`` > 1); each rank holds num_experts / EP
local experts, replicated over the expert-DP group of DP*TP / EP ranks. The variants:

* ``canzona`` -- the dense and the expert Canzona optimizers chained: each dense matrix
  computed once over DP x TP, each expert matrix once over its expert-DP group;
* ``sync`` -- at TP 1 every rank runs Muon on every matrix it holds: all dense matrices and
  its local experts. That is synchronous compute under EP: DDP all-reduces dense gradients
  over DP and expert gradients over expert-DP, so every replica of a matrix computes the same
  update (it ends within fp32 rounding of ``canzona``'s parameters). At TP > 1 it is
  Canzona's ``sync`` TP mode, as without experts;
* ``megatron`` -- Megatron's layer-wise Muon, wired as ``megatron.training`` wires it:
  expert buffers laid out and sharded over expert-DP, each matrix computed once over its
  (expert-)DP group. One difference in the math: Megatron's Muon takes every 2-D
  non-embedding weight, so it also orthogonalizes the MoE routers, which Canzona (like the
  ``sync`` variant) leaves to AdamW (its rows are per-expert logits) -- one small matrix
  (experts x hidden) per layer; with the routers on AdamW the two end within rounding.

Matrices per step and rank (parameter tensors, a fused QKV as one) are what each Canzona
rank reports computing; for ``sync`` at TP 1 the matrices the rank holds; for ``megatron``
the mean over ranks from the shapes (routers included), as its per-rank split is not
reported. The ideal ``canzona / sync`` is a perfectly balanced share of the plan's cost
against what a ``sync`` rank computes. Host-group bytes are not measured under ``--moe``
(the harness reports them for a single Canzona optimizer, not a dense + expert chain).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from megatron.canzona.cli import ArgumentParser, at_least, fraction, non_negative, positive
from megatron.canzona.curves import save_figure
from megatron.canzona.planning import CanzonaPlan
from megatron.canzona.planning.grid import expert_dp_size as grid_expert_dp_size
from megatron.canzona.provenance import git_revision, machine
from megatron.canzona.runtime import LaunchConfig, launch
from canzona_patches.harness.tiny_gpt import TinyRun, swiglu_ffn_hidden, train_tiny_gpts

DP_VARIANTS = {"canzona": ("muon", "async", "whole"), "canzona_lean": ("muon", "async", "lean"),
               "sync": ("sync_muon", "async", "whole"), "megatron": ("megatron_muon", "async", "whole")}
TP_VARIANTS = {"canzona": ("muon", "async", "whole"), "canzona_lean": ("muon", "async", "lean"),
               "sync": ("muon", "sync", "whole"), "megatron": ("megatron_muon", "async", "whole")}
"""Variant -> (TinyRun optimizer, Canzona TP mode, Canzona DP layout). ``canzona`` is the whole
layout (every matrix whole in one DP rank's shard), ``canzona_lean`` the lean one (equal shards;
with ``--bucket-size`` below a matrix's size its pieces are gathered to a host in the step)."""
STAGE_COLOURS = {"gather": "tab:blue", "compute": "tab:orange", "scatter": "tab:green", "apply": "tab:red"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=at_least(1), default=2, help="data-parallel size")
    parser.add_argument("--tp", type=at_least(1), default=1, help="tensor-parallel size (processes = dp * tp)")
    parser.add_argument("--gantt", metavar="FILE.png", help="with --tp > 1: timeline of one async step")
    parser.add_argument("--layers", type=at_least(1), default=4, help="transformer layers")
    parser.add_argument("--hidden", type=at_least(1), default=384, help="hidden size (4 heads, 2 query groups)")
    parser.add_argument("--ffn-hidden", type=at_least(1), default=None, help="SwiGLU size (default: 8/3 hidden)")
    parser.add_argument("--bucket-size", type=at_least(1), default=None,
                        help="DDP bucket size in elements (small buckets split matrices across DP shards)")
    parser.add_argument("--alpha", type=fraction, default=0.5, help="Canzona planner balance knob")
    parser.add_argument("--steps", type=at_least(1), default=10, help="timed steps per variant (after --warmup)")
    parser.add_argument("--warmup", type=at_least(0), default=2, help="untimed first steps per variant and round")
    parser.add_argument("--rounds", type=at_least(1), default=3,
                        help="variants run in turn this many times, so load drift hits them alike")
    parser.add_argument("--moe", action="store_true", help="mixture of experts in every layer (see --num-experts)")
    parser.add_argument("--num-experts", type=at_least(1), default=8, help="with --moe: experts per layer")
    parser.add_argument("--ep", type=at_least(1), default=None, help="with --moe: expert-parallel size (default 2)")
    parser.add_argument("--moe-ffn-hidden", type=at_least(1), default=None,
                        help="with --moe: each expert's SwiGLU size (default: hidden / 2)")
    parser.add_argument("--moe-topk", type=at_least(1), default=2, help="with --moe: experts per token")
    parser.add_argument("--iteration", action="store_true",
                        help="time the exposed optimizer time of whole iterations instead: from the end of "
                        "backward to the next forward's first transformer layer, with --overlap-grad-reduce and "
                        "(distributed optimizers) --overlap-param-gather")
    parser.add_argument("--clip-grad", type=non_negative, default=0.0,
                        help="Megatron's global-norm clip (0: none); e.g. 1e-3 acts in every step, 1e9 in none")
    parser.add_argument("--fsdp", choices=("optim", "optim_grads", "optim_grads_params"), default=None,
                        help="under Megatron-FSDP with this sharding strategy: Canzona's Muon step against Megatron's "
                        "AdamW-FSDP step, and each rank's host-group bytes against the plan's")
    parser.add_argument("--narrow-gathers", action="store_true",
                        help="with --fsdp: also Canzona's Muon iterating in bf16 with --canzona-narrow-gathers (its "
                        "input gathered in bf16, normalised by the holders), its bytes against the plan's too")
    parser.add_argument("--timeout", type=positive, default=900.0, help="seconds before a hung launch fails")
    parser.add_argument("--json", metavar="FILE", help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.dp < 1 or args.tp < 1:
        parser.error(f"--dp {args.dp} and --tp {args.tp} must be at least 1")
    if args.narrow_gathers and not args.fsdp:
        parser.error("--narrow-gathers sends Muon's input to its hosts in bf16 under Megatron-FSDP: add --fsdp")
    if args.fsdp and (args.gantt or args.moe):
        parser.error("--fsdp times the dense model without --gantt: drop --gantt/--moe")
    if args.iteration and (args.gantt or args.moe):
        parser.error("--iteration times the dense model without --gantt; drop --moe/--gantt")
    if args.gantt and (args.tp == 1 or args.moe):
        parser.error("--gantt draws the dense TP pipeline: add --tp 2, without --moe")
    if not args.clip_grad >= 0.0:
        parser.error(f"--clip-grad {args.clip_grad} must be 0 (no clip) or a positive norm")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1 and --warmup at least 0")
    if args.hidden % 4:
        parser.error(f"--hidden {args.hidden} must be a multiple of the 4 attention heads")
    # 8/3 hidden, rounded to a multiple of 64 so it splits over TP ranks.
    args.ffn_hidden = args.ffn_hidden or swiglu_ffn_hidden(args.hidden)
    check_moe_args(parser, args)
    return args


def check_moe_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the MoE defaults (``ep_size`` 1 and no experts without ``--moe``) and check them."""
    if not args.moe:
        if args.ep is not None:
            parser.error("--ep needs --moe")
        args.ep, args.num_experts = 1, 0
        return
    args.ep = 2 if args.ep is None else args.ep
    args.moe_ffn_hidden = args.moe_ffn_hidden or max(64, args.hidden // 2)
    world = args.dp * args.tp
    if args.ep < 1 or world % args.ep:
        parser.error(f"--ep {args.ep} must divide the {world} processes (--dp {args.dp} x --tp {args.tp})")
    if args.num_experts < 1 or args.num_experts % args.ep:
        parser.error(f"--num-experts {args.num_experts} must be a positive multiple of --ep {args.ep}")
    if not 1 <= args.moe_topk <= args.num_experts:
        parser.error(f"--moe-topk {args.moe_topk} must lie in 1..{args.num_experts} (--num-experts)")


LATE_GATHER = "canzona_late"
"""With ``--iteration`` at TP > 1: ``canzona`` with ``--canzona-no-early-gather`` (host-group
gathers issued in the step rather than as the buckets finish reducing)."""


ADAMW = "adamw"
"""With ``--iteration``: Megatron's distributed AdamW, the iteration Muon's should cost."""

EARLY_COMPUTE = "canzona_early"
"""With ``--iteration``: ``canzona`` with ``--canzona-early-compute on``, each micro-group's gather
issued from the reduce-scatters' dispatch as on CUDA (on gloo the host waits for each
reduce-scatter there), its compute once backward is over, before the step, in the iterations the
speculation policy picks."""
DEFAULT = "canzona_default"
"""With ``--iteration``: ``canzona`` as ``pretrain_gpt.py --canzona`` runs it by default
(``--canzona-early-compute auto``: decided per run; on gloo, computed in the step). ``canzona``
itself is ``--canzona-no-early-compute``."""


MATRICES_FIRST = "canzona_first"
"""With ``--iteration``: :data:`EARLY_COMPUTE` with ``--canzona-matrices-reduce-first`` on: the
dense buckets without a matrix held in backward and reduced after the last one with a matrix
(what the hold costs on every iteration's path, per bucket: its forward-backward and exposed
time against :data:`EARLY_COMPUTE`'s)."""


def variants(args: argparse.Namespace) -> dict[str, tuple[str, str, str]]:
    if not args.iteration:
        return DP_VARIANTS if args.tp == 1 else TP_VARIANTS
    extra = {DEFAULT: ("muon", "async", "whole"), EARLY_COMPUTE: ("muon", "async", "whole"),
             MATRICES_FIRST: ("muon", "async", "whole"), ADAMW: ("adam", "async", "whole")}
    if args.tp == 1:
        return {**DP_VARIANTS, **extra}
    return {**TP_VARIANTS, LATE_GATHER: TP_VARIANTS["canzona"], **extra}


def runs_for(args: argparse.Namespace) -> list[TinyRun]:
    global_batch = 2 * args.dp  # one micro-batch of 2 sequences per rank: the step dominates
    return [
        TinyRun(
            optimizer=optimizer, tp_mode=tp_mode, tp_size=args.tp, canzona_layout=layout,
            layout="canzona" if optimizer == "muon" else "megatron",
            num_steps=args.warmup + args.steps + (1 if args.iteration else 0), global_batch=global_batch,
            micro_batch=2, overlap_grad_reduce=args.iteration, time_iteration=args.iteration,
            overlap_param_gather=args.iteration and optimizer != "sync_muon",
            lr=1e-3, weight_decay=0.1, num_layers=args.layers, hidden=args.hidden,
            ffn_hidden=args.ffn_hidden, bucket_size=args.bucket_size, alpha=args.alpha,
            early_gather=name != LATE_GATHER,
            early_compute="auto" if name == DEFAULT else name in (EARLY_COMPUTE, MATRICES_FIRST),
            early_gather_at_dispatch=name in (EARLY_COMPUTE, MATRICES_FIRST), speculation="backoff",
            clip_grad=args.clip_grad,
            matrices_first=True if name == MATRICES_FIRST else None,
            **(dict(num_experts=args.num_experts, ep_size=args.ep, moe_ffn_hidden=args.moe_ffn_hidden,
                    moe_topk=args.moe_topk) if args.moe else {}),
        )
        for _ in range(args.rounds)
        for name, (optimizer, tp_mode, layout) in variants(args).items()
    ]


def step_times(per_rank: list[dict], warmup: int) -> list[float]:
    """Per timed step, the slowest rank's ``optimizer.step()`` seconds."""
    return [max(steps) for steps in zip(*(r["step_seconds"] for r in per_rank))][warmup:]


def exposed_times(per_rank: list[dict], warmup: int) -> list[float]:
    """Per timed iteration, the slowest rank's exposed optimizer seconds: from the end of its
    backward (its last micro-batch's) to its next forward's first transformer layer. One
    micro-batch per rank and iteration here, so mark k belongs to iteration k."""
    per_rank_exposed = []
    for r in per_rank:
        marks = r["iteration_marks"]
        ends, starts = marks["backward_end"], marks["forward_start"]
        if len(starts) != len(ends):
            raise RuntimeError(f"{len(starts)} forward marks against {len(ends)} backward marks; one micro-batch "
                               "per rank and iteration is what --iteration times")
        per_rank_exposed.append([start - end for end, start in zip(ends, starts[1:])])
    return [max(times) for times in zip(*per_rank_exposed)][warmup:]


def iteration_parts(per_rank: list[dict], warmup: int) -> dict[str, list[float]]:
    """Per timed iteration, the slowest rank's forward-backward, exposed optimizer time (end of
    backward to the end of ``optimizer.step()``: the reduce-scatter's tail, clipping, the step)
    and the rest (to the next forward's first layer: zeroing, the next batch, parameter
    all-gathers not hidden), and their sum, the whole iteration."""
    def slowest(spans: list[list[float]]) -> list[float]:
        return [max(times) for times in zip(*spans)][warmup:]

    marks = [r["iteration_marks"] for r in per_rank]
    parts = {
        "forward_backward": slowest([[e - s for s, e in zip(m["forward_start"], m["backward_end"])] for m in marks]),
        "exposed_optimizer": slowest([[s - e for e, s in zip(m["backward_end"], m["step_end"])] for m in marks]),
        "rest": slowest([[f - s for s, f in zip(m["step_end"], m["forward_start"][1:])] for m in marks]),
        "iteration": slowest([[b - a for a, b in zip(m["forward_start"], m["forward_start"][1:])] for m in marks]),
    }
    return parts


def forward_backward_times(per_rank: list[dict], warmup: int) -> list[float]:
    """Per timed iteration, the slowest rank's forward and backward: from its first
    transformer layer's forward to the end of its backward."""
    per_rank_times = [[end - start for start, end in zip(r["iteration_marks"]["forward_start"],
                                                          r["iteration_marks"]["backward_end"])] for r in per_rank]
    return [max(times) for times in zip(*per_rank_times)][warmup:]


def megatron_duplicated_bytes(params: dict, args: argparse.Namespace) -> float:
    """Mean bytes a rank sends per step in Megatron's duplicated TP mode: every TP rank
    all-gathers each TP-sharded matrix of its DP rank (fp32, (tp-1) shards each). Experts
    (expert TP 1 under EP) are not sharded."""
    sharded = [p for n, p in params.items() if n.endswith(MATRIX_SUFFIXES) and not is_expert_name(n)]
    total = sum(p.numel() // args.tp * 4 * (args.tp - 1) * args.tp for p in sharded)
    return total / (args.dp * args.tp)


MATRIX_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
"""The weights every variant gives Muon (TP-sharded when dense); not embeddings, output, routers."""


def is_expert_name(name: str) -> bool:
    return ".local_experts." in name


def matrices_per_rank(last: dict[str, list[dict]], args: argparse.Namespace) -> dict[str, object]:
    """Matrices (parameter tensors) each rank computes per step: Canzona's reported updates,
    at TP 1 every matrix a ``sync`` rank holds, Megatron's mean from the shapes (each Muon
    matrix, routers included, once over its DP or expert-DP group)."""
    names = set().union(*(r["params"] for r in last["canzona"]))  # experts by global index
    experts = sum(n.endswith(MATRIX_SUFFIXES) and is_expert_name(n) for n in names)
    dense = sum(n.endswith(MATRIX_SUFFIXES) and not is_expert_name(n) for n in names)
    routers = sum(n.endswith("router.weight") for n in names)
    expert_dp = expert_dp_size(args)
    sync = ([sum(n.endswith(MATRIX_SUFFIXES) for n in r["params"]) for r in last["sync"]] if args.tp == 1
            else [len(r["updated"]) for r in last["sync"]])
    return {
        "model": {"dense": dense, "experts": experts, "routers": routers},
        **{name: [len(r["updated"]) for r in last[name]]
           for name in ("canzona", "canzona_lean", LATE_GATHER, DEFAULT, EARLY_COMPUTE, MATRICES_FIRST) if name in last},
        "sync": sync,
        "megatron_mean": (dense + routers) / args.dp + experts / args.ep / expert_dp,
    }


def expert_dp_size(args: argparse.Namespace) -> int:
    """Ranks holding the same experts: expert TP is 1 under EP, else the TP size (tiny_gpt)."""
    return grid_expert_dp_size(dp_size=args.dp, tp_size=args.tp, ep_size=args.ep,
                               expert_tp_size=1 if args.ep > 1 else args.tp)


def ideal_ratio(plan: CanzonaPlan, args: argparse.Namespace) -> float:
    """Canzona's step against ``sync``'s if the plan's cost were spread evenly over all
    ranks: ``sync`` computes every matrix it holds at TP 1, its DP rank's share at TP > 1."""
    dense = sum(h.cost for h in plan.hosts)
    local_experts = 0.0 if plan.experts is None else sum(h.cost for h in plan.experts.hosts)
    canzona = statistics.mean(plan.combined_loads())
    if args.tp == 1:
        return canzona / (dense + local_experts)
    expert_dp = 1 if plan.experts is None else plan.experts.dp_size
    return canzona / (dense / args.dp + local_experts / expert_dp)


def draw_gantt(per_rank: list[dict], path: str) -> None:
    """One async step: per rank one lane per stage (gather, compute, scatter, apply), each bar
    a micro-group, so communication in flight can be seen beside compute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = [r["tp_stats"]["timeline"] for r in per_rank]
    origin = min(start for timeline in timelines for _, _, start, _ in timeline)
    lanes = list(STAGE_COLOURS)
    rows = len(lanes) + 1  # a blank lane between ranks
    fig, ax = plt.subplots(figsize=(11, 0.6 + 0.35 * rows * len(timelines)))
    for rank, timeline in enumerate(timelines):
        for stage, group, start, end in timeline:
            y = rank * rows + lanes.index(stage)
            ax.barh(y, 1e3 * (end - start), left=1e3 * (start - origin), height=0.8,
                    color=STAGE_COLOURS[stage], edgecolor="black", linewidth=0.4)
            ax.text(1e3 * (start - origin), y, f" {group}", va="center", fontsize=6)
    ax.set_yticks([r * rows + i for r in range(len(timelines)) for i in range(len(lanes))],
                  [f"rank {r} {lane}" for r in range(len(timelines)) for lane in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first collective (bar label: micro-group)")
    ax.set_title("Canzona TP async optimizer step (gather/scatter spans: issue to completion)")
    save_figure(fig, path, dpi=120)
    print(f"wrote {path}")


FSDP_VARIANTS = {"canzona": ("muon", "canzona", {}), "every_holder": ("every_holder", "megatron", {}),
                 "adamw": ("adam", "megatron", {}),
                 "canzona_narrow": ("muon", "canzona", {"muon_ns_dtype": "bfloat16", "narrow_gathers": True})}
"""With ``--fsdp``: variant -> (TinyRun optimizer, layout, other TinyRun fields): Canzona's Muon over
Megatron-FSDP's shards; the peer design that gathers each matrix to every rank holding a piece of it,
each running Muon on it (#4486; TP 1 only); Megatron's own Adam under Megatron-FSDP (what
Megatron-Core 0.19.2 allows there); with ``--narrow-gathers``, Canzona's Muon iterating in bf16 with
its input gathered in bf16."""


def fsdp_main(args: argparse.Namespace) -> int:
    """``--fsdp``: the optimizer step of Canzona's Muon and of Megatron's AdamW under
    Megatron-FSDP, variants taking turns round by round; each rank's host-group bytes (gathers and
    scatters, measured by the engine) beside the plan's (``planning.comm.traffic``)."""
    from megatron.canzona.planning.comm import WireConfig, rank_index, traffic
    from megatron.canzona.planning.schedule import plan_schedule

    variants = {k: v for k, v in FSDP_VARIANTS.items()
                if (args.tp == 1 or k != "every_holder") and (args.narrow_gathers or k != "canzona_narrow")}
    runs = [TinyRun(optimizer=optimizer, layout=layout, fsdp=args.fsdp, early_gather=False, overlap_grad_reduce=True,
                    num_steps=args.warmup + args.steps, global_batch=2 * args.dp * args.tp, micro_batch=2,
                    tp_size=args.tp, lr=1e-3, weight_decay=0.1, num_layers=args.layers, hidden=args.hidden,
                    ffn_hidden=args.ffn_hidden, bucket_size=args.bucket_size, alpha=args.alpha, clip_grad=args.clip_grad,
                    **fields)
            for _ in range(args.rounds) for optimizer, layout, fields in variants.values()]
    print(f"bench_step: Megatron-FSDP {args.fsdp}, TP {args.tp} x DP {args.dp} on gloo, {args.layers} layers, hidden "
          f"{args.hidden}; {args.rounds} rounds of {args.warmup} + {args.steps} steps per variant ...", flush=True)
    start = time.perf_counter()
    per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=args.dp * args.tp, timeout_s=args.timeout), runs)
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, list[dict]] = {}
    for i in range(len(runs)):
        name = names[i % len(names)]
        last[name] = [rank[i] for rank in per_rank]
        times[name] += step_times(last[name], args.warmup)
    medians = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    wire = WireConfig(param_bytes=4, grad_bytes=4)  # the harness trains in fp32

    def bytes_of(variant: str) -> tuple[list[int], list[float]]:
        """Each rank's host-group bytes, measured by its engine and priced by the plan's traffic."""
        plan, narrow = CanzonaPlan.from_json(last[variant][0]["plan"]), last[variant][0]["planned_narrow"]
        predicted = traffic([dp.matrix for dp in plan.layouts], plan_schedule(plan).tasks, dp_size=plan.dp_size,
                            tp_size=plan.tp_size, wire=wire, narrow=narrow["updates"], gathers=narrow["gathers"])
        at = [predicted[rank_index(*r["host_coord"], plan.tp_size)] for r in last[variant]]
        return [r["tp_stats"]["bytes_sent"] for r in last[variant]], [t.host_gather + t.host_scatter for t in at]

    measured, planned = bytes_of("canzona")
    narrow_bytes = bytes_of("canzona_narrow") if "canzona_narrow" in last else None
    report = {"fsdp": args.fsdp, "dp_size": args.dp, "tp_size": args.tp,
              "model": {"layers": args.layers, "hidden": args.hidden, "ffn_hidden": args.ffn_hidden},
              "timed_steps_per_variant": args.rounds * args.steps, "median_step_ms": medians,
              "canzona_over_adamw": medians["canzona"] / medians["adamw"],
              "host_group_bytes_per_rank": measured, "planned_host_group_bytes_per_rank": planned,
              "narrow_gathers_bytes_per_rank": narrow_bytes and narrow_bytes[0],
              "planned_narrow_gathers_bytes_per_rank": narrow_bytes and narrow_bytes[1],
              "bytes_equal_plan": measured == planned and (narrow_bytes is None or narrow_bytes[0] == narrow_bytes[1]),
              "wall_seconds": time.perf_counter() - start,
              "every_holder_bytes_per_rank": [r["tp_stats"]["bytes_sent"] for r in last["every_holder"]]
              if "every_holder" in last else None,
              "git_revision": git_revision(), "machine": machine()}
    print(f"{'variant':<16}{'step ms':>10}{'/ adamw':>9}{'/ canzona':>11}")
    for name in names:
        print(f"{name:<16}{medians[name]:>10.2f}{medians[name] / medians['adamw']:>9.2f}"
              f"{medians[name] / medians['canzona']:>11.2f}")
    if report["every_holder_bytes_per_rank"] is not None:
        print("every-holder all-gather bytes per rank: " + ", ".join(
            f"rank {k}: {b:,}" for k, b in enumerate(report["every_holder_bytes_per_rank"])))
    rows = [("", (measured, planned))] + ([(" with narrow gathers", narrow_bytes)] if narrow_bytes else [])
    for label, (got, plan_bytes) in rows:
        print(f"host-group bytes per rank{label} (measured | plan): " + ", ".join(
            f"rank {k}: {m:,} | {p:,.0f}" for k, (m, p) in enumerate(zip(got, plan_bytes)))
            + ("  (equal)" if got == plan_bytes else "  (DIFFER)"))
    emit_json(report, args.json)
    return 0 if report["bytes_equal_plan"] else 1


FSDP_ITERATION_VARIANTS = {
    ADAMW: ("adam", "megatron", {}),
    "canzona": ("muon", "canzona", {"early_compute": "auto", "speculation": "backoff"}),
    LATE_GATHER: ("muon", "canzona", {"early_gather": False}),
    "every_holder": ("every_holder", "megatron", {"early_gather": False}),
    "canzona_narrow": ("muon", "canzona", {"early_compute": "auto", "speculation": "backoff",
                                           "muon_ns_dtype": "bfloat16", "narrow_gathers": True}),
}
"""With ``--fsdp --iteration``: variant -> (TinyRun optimizer, layout, other TinyRun fields):
Megatron's AdamW under Megatron-FSDP; Canzona's Muon with ``pretrain_gpt.py --canzona``'s defaults
(early gathers, ``--canzona-early-compute auto``, the backoff speculation); the same gathering in the
step (``--canzona-no-early-gather``); the gather-to-every-holder peer (TP 1); with ``--narrow-gathers``,
Canzona's Muon in bf16 with its input gathered in bf16."""


def fsdp_iteration_runs(args: argparse.Namespace) -> tuple[dict[str, tuple[str, str, dict]], list[TinyRun]]:
    """With ``--fsdp --iteration``: the variants that run and their runs, round by round (one
    micro-batch per rank and iteration, Megatron-FSDP's collectives overlapped, one more iteration
    than timed: the last one's forward closes the iteration before it)."""
    variants = {k: v for k, v in FSDP_ITERATION_VARIANTS.items()
                if (args.tp == 1 or k != "every_holder") and (args.narrow_gathers or k != "canzona_narrow")}
    runs = [TinyRun(optimizer=optimizer, layout=layout, fsdp=args.fsdp, overlap_grad_reduce=True,
                    overlap_param_gather=True, time_iteration=True,
                    num_steps=args.warmup + args.steps + 1, global_batch=2 * args.dp, micro_batch=2,
                    tp_size=args.tp, lr=1e-3, weight_decay=0.1, num_layers=args.layers, hidden=args.hidden,
                    ffn_hidden=args.ffn_hidden, bucket_size=args.bucket_size, alpha=args.alpha, clip_grad=args.clip_grad,
                    **fields)
            for _ in range(args.rounds) for optimizer, layout, fields in variants.values()]
    return variants, runs


def fsdp_iteration_main(args: argparse.Namespace) -> int:
    """``--fsdp --iteration``: whole iterations under Megatron-FSDP, its collectives overlapped; each
    variant's iteration in its parts (the slowest rank's medians), its ratio to AdamW's round by
    round, and what the early gathers did before the step (gathers issued in backward, Muon's
    sources made, exact norms taken ahead of the gather)."""
    variants, runs = fsdp_iteration_runs(args)
    print(f"bench_step: whole iterations under Megatron-FSDP {args.fsdp}, TP {args.tp} x DP {args.dp} on gloo, "
          f"{args.layers} layers, hidden {args.hidden}; {args.rounds} rounds of {args.warmup} + {args.steps} "
          "iterations per variant ...", flush=True)
    start = time.perf_counter()
    per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=args.dp * args.tp, timeout_s=args.timeout), runs)
    names = list(variants)
    every: dict[str, list[list[dict]]] = {name: [] for name in names}
    for i in range(len(runs)):
        every[names[i % len(names)]].append([rank[i] for rank in per_rank])
    parts = {name: {part: 1e3 * statistics.median(t for r in rounds
                                                  for t in iteration_parts(r, args.warmup)[part][:args.steps])
                    for part in ("forward_backward", "exposed_optimizer", "rest", "iteration")}
             for name, rounds in every.items()}
    last = {name: rounds[-1] for name, rounds in every.items()}
    report = {
        "fsdp": args.fsdp, "dp_size": args.dp, "tp_size": args.tp,
        "model": {"layers": args.layers, "hidden": args.hidden, "ffn_hidden": args.ffn_hidden},
        "measured": "whole iterations, Megatron-FSDP's collectives overlapped: forward-backward (first layer's "
                    "forward to the end of backward), exposed optimizer (to the end of optimizer.step()), rest (to "
                    "the next forward's first layer); the slowest rank's, medians over every timed iteration",
        "timed_iterations_per_variant": args.rounds * args.steps, "clip_grad": args.clip_grad,
        "iteration_parts_ms": parts,
        "iteration_over_adamw": {name: iteration_ratios(every[name], every[ADAMW], args.warmup) for name in names},
        "early_gathers_in_backward": {name: [r["early_gathers_in_backward"] for r in last[name]] for name in names},
        "early_sources_made": {name: [r["early_sources_made"] for r in last[name]] for name in names},
        "norms_ahead": {name: [r["norms_ahead"] for r in last[name]] for name in names},
        "norms_at_gather": {name: [r["norms_at_gather"] for r in last[name]] for name in names},
        "steps_by_outcome": {name: last[name][0]["early_steps"][0] if last[name][0]["early_steps"] else None
                             for name in names},
        "wall_seconds": time.perf_counter() - start, "git_revision": git_revision(), "machine": machine(),
    }
    print(f"\n{'variant':<16} {'fwd-bwd (ms)':>13} {'exposed opt.':>13} {'rest':>8} {'iteration':>10} "
          f"{'iteration / adamw (rounds)':>30}")
    for name in names:
        p, r = parts[name], report["iteration_over_adamw"][name]
        print(f"{name:<16} {p['forward_backward']:>13.2f} {p['exposed_optimizer']:>13.2f} {p['rest']:>8.2f} "
              f"{p['iteration']:>10.2f} {r['median']:>12.3f} ({r['min']:.3f}-{r['max']:.3f})")
    for name in names:
        if name.startswith("canzona") and name != LATE_GATHER:
            print(f"{name}: gathers issued in backward per rank {report['early_gathers_in_backward'][name]}, Muon's "
                  f"sources made before the step {report['early_sources_made'][name]} elements, exact norms taken as "
                  f"their buckets reduced {report['norms_ahead'][name]} (at the gather {report['norms_at_gather'][name]})"
                  + (f", steps by outcome {report['steps_by_outcome'][name]}" if report['steps_by_outcome'][name] else ""))
    emit_json(report, args.json)
    return 0


def emit_json(report: dict, path: str | None) -> None:
    """Print the JSON report, and write it to ``path`` (``--json``) too."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        with open(path, "w") as stream:
            stream.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The ranks inherit it: Megatron's and torch's notices (deprecations, CPU fallbacks) say
    # nothing about the timings printed below.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning")
    if args.fsdp:
        return fsdp_iteration_main(args) if args.iteration else fsdp_main(args)
    runs = runs_for(args)
    moe = (f"; {args.num_experts} experts (ffn {args.moe_ffn_hidden}, top {args.moe_topk}) over EP {args.ep}"
           if args.moe else f", ffn {args.ffn_hidden}")
    print(f"bench_step: TP {args.tp} x DP {args.dp} on gloo, {args.layers} layers, hidden {args.hidden}{moe}; "
          f"{args.rounds} rounds of {args.warmup} + {args.steps} steps per variant ...", flush=True)
    start = time.perf_counter()
    per_rank = launch(train_tiny_gpts, LaunchConfig(world_size=args.dp * args.tp, timeout_s=args.timeout), runs)
    names = list(variants(args))
    rounds: dict[str, list[list[float]]] = {name: [] for name in names}
    last: dict[str, list[dict]] = {}
    every: dict[str, list[list[dict]]] = {name: [] for name in names}
    for i in range(len(runs)):
        name = names[i % len(names)]
        last[name] = [rank[i] for rank in per_rank]
        every[name].append(last[name])
        rounds[name].append((exposed_times if args.iteration else step_times)(last[name], args.warmup))
    report = summarize(args, rounds, last)
    if args.iteration:
        report["iteration_over_no_early_compute"] = {
            name: iteration_ratios(every[name], every["canzona"], args.warmup) for name in (DEFAULT, EARLY_COMPUTE)}
    report["wall_seconds"] = time.perf_counter() - start
    print_table(report, names)
    if args.iteration:
        print_iteration_table(report, names)
    if args.gantt:
        draw_gantt(last["canzona"], args.gantt)
    emit_json(report, args.json)
    return 0


def summarize(args: argparse.Namespace, rounds: dict[str, list[list[float]]], last: dict[str, list[dict]]) -> dict:
    """The JSON report: configuration, medians and ratios, matrices and bytes per rank.
    ``rounds[variant][k]`` are the timed steps of round k (variants interleave round by round)."""
    world = args.dp * args.tp
    medians = {name: statistics.median(t for r in times for t in r) for name, times in rounds.items()}
    plan = CanzonaPlan.from_json(last["canzona"][0]["plan"])
    report = {
        "dp_size": args.dp,
        "tp_size": args.tp,
        "model": {"layers": args.layers, "hidden": args.hidden, "ffn_hidden": None if args.moe else args.ffn_hidden},
        "moe": {"num_experts": args.num_experts, "ep_size": args.ep, "expert_dp_size": expert_dp_size(args),
                "moe_ffn_hidden": args.moe_ffn_hidden, "topk": args.moe_topk} if args.moe else None,
        "measured": ("exposed optimizer time per iteration: end of backward to the next forward's first layer, "
                     "overlapped grad reduce and param gather" if args.iteration else "optimizer.step() after a barrier"),
        "timed_steps_per_variant": args.rounds * args.steps,
        "median_step_ms": {name: 1e3 * m for name, m in medians.items()},
        "round_step_ms": {name: [[1e3 * t for t in r] for r in times] for name, times in rounds.items()},
        "ratio_to_sync": {name: m / medians["sync"] for name, m in medians.items()},
        "ratio_to_megatron": {name: m / medians["megatron"] for name, m in medians.items()},
        "ideal_ratio_to_sync": ideal_ratio(plan, args),
        "canzona_speedup_over_megatron": medians["megatron"] / medians["canzona"],
        "matrices_per_rank_step": matrices_per_rank(last, args),
        "git_revision": git_revision(),
        "machine": machine(),
    }
    plans = [plan] if plan.experts is None else [plan, plan.experts]
    if args.iteration:  # what the simulator needs to place the overlapped collectives (validate_simulate.py)
        report["median_forward_backward_ms"] = {
            name: 1e3 * statistics.median(forward_backward_times(last[name], args.warmup)) for name in last}
        report["iteration_parts_ms"] = {
            name: {part: 1e3 * statistics.median(times) for part, times in iteration_parts(last[name], args.warmup).items()}
            for name in last}
        report["early_compute"] = early_compute_summary(report["iteration_parts_ms"], last)
        report["clip_grad"] = args.clip_grad
        report["reduces_held_per_rank"] = [r["reduces_held"] for r in last[MATRICES_FIRST]]
    report["split_matrices"] = sum(p.host is None for part in plans for p in part.dp.matrix.placements)
    if args.moe:  # tiny_gpt reports the bytes of one Canzona optimizer, not of a dense + expert chain
        report["host_group_bytes_per_rank_step"] = None
        return report
    host_names = [n for n in ("canzona", "canzona_lean", LATE_GATHER, DEFAULT, EARLY_COMPUTE, MATRICES_FIRST, "sync")
                  if n in last and (args.tp > 1 or n != "sync")]
    report["host_group_bytes_per_rank_step"] = {
        name: sum(r["tp_stats"]["bytes_sent"] for r in last[name]) / world for name in host_names
    }
    if args.tp > 1:
        report["host_group_bytes_per_rank_step"]["megatron"] = megatron_duplicated_bytes(last["canzona"][0]["params"], args)
    return report


def iteration_ratios(ours: list[list[dict]], theirs: list[list[dict]], warmup: int) -> dict[str, float]:
    """Round by round (the variants take turns), the median of ``ours``' whole iterations over the
    median of ``theirs``' (the slowest rank's each): the median and spread of those ratios."""
    ratios = [statistics.median(iteration_parts(a, warmup)["iteration"]) /
              statistics.median(iteration_parts(b, warmup)["iteration"]) for a, b in zip(ours, theirs)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}


def early_compute_summary(parts: dict[str, dict[str, float]], last: dict[str, list[dict]]) -> dict:
    """Early compute against computing in the step: the exposed optimizer time of each, the
    share of micro-groups computed before the step (after backward: the runtime computes
    nothing beside it), and the steps by outcome of the speculation policy."""
    early, step = parts[EARLY_COMPUTE]["exposed_optimizer"], parts["canzona"]["exposed_optimizer"]
    runs = last[EARLY_COMPUTE]
    groups = len({index for r in runs for _, index, _, _ in r["tp_stats"]["timeline"]}) or 1
    steps = max(1, len(runs[0]["losses"]))
    share = min(1.0, max(r["early_computed"] or 0 for r in runs) / (groups * steps))
    return {"exposed_optimizer_ms": {"in_step": step, "early": early}, "fall": 1.0 - early / step,
            "share_of_groups_computed_before_the_step": share, "micro_groups": groups,
            "steps_by_outcome": runs[0]["early_steps"][0], "default_steps_by_outcome": last[DEFAULT][0]["early_steps"][0]}


def print_iteration_table(report: dict, names: list[str]) -> None:
    """With ``--iteration``: each variant's iteration in its parts, and forward-backward and the
    whole iteration against Megatron's layer-wise Muon's and AdamW's (medians of the last round)."""
    parts = report["iteration_parts_ms"]
    print(f"\n{'variant':<14} {'fwd-bwd (ms)':>13} {'exposed opt.':>13} {'rest':>8} {'iteration':>10} "
          f"{'fwd-bwd / megatron':>19} {'iteration / megatron':>21} {'iteration / adamw':>18}")
    for name in names:
        p = parts[name]
        print(f"{name:<14} {p['forward_backward']:>13.2f} {p['exposed_optimizer']:>13.2f} {p['rest']:>8.2f} "
              f"{p['iteration']:>10.2f} {p['forward_backward'] / parts['megatron']['forward_backward']:>19.3f} "
              f"{p['iteration'] / parts['megatron']['iteration']:>21.3f} {p['iteration'] / parts[ADAMW]['iteration']:>18.3f}")
    early = report["early_compute"]
    exposed = early["exposed_optimizer_ms"]
    print(f"early compute: exposed optimizer time {exposed['early']:.2f} ms against {exposed['in_step']:.2f} ms computing "
          f"in the step ({100 * early['fall']:.1f}% less); {100 * early['share_of_groups_computed_before_the_step']:.0f}% "
          f"of the {early['micro_groups']} micro-groups computed before the step; steps by outcome "
          f"{early['steps_by_outcome']} (clip {report['clip_grad']:g})")
    ratios = report["iteration_over_no_early_compute"]
    print("iteration over canzona (--canzona-no-early-compute), median of the rounds' (spread): " + ", ".join(
        f"{name} {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" for name, r in ratios.items()))
    print(f"{MATRICES_FIRST}: reduce-scatters held behind the matrices' per rank over the run: "
          f"{', '.join(str(n) for n in report['reduces_held_per_rank'])}")


def print_table(report: dict, names: list[str]) -> None:
    matrices = report["matrices_per_rank_step"]
    column = "exposed (ms)" if report["measured"].startswith("exposed") else "median step (ms)"
    print(f"{'variant':<12} {column:>17} {'/ sync':>8} {'/ megatron':>11} {'matrices/rank':>14} "
          f"{'host-group bytes/rank':>22}")
    for name in names:
        sent = (report["host_group_bytes_per_rank_step"] or {}).get(name)
        counts = matrices.get(name)
        counts = ("-" if name == ADAMW else f"{matrices['megatron_mean']:.2f} mean" if counts is None
                  else f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}")
        print(f"{name:<12} {report['median_step_ms'][name]:>17.2f} {report['ratio_to_sync'][name]:>8.3f} "
              f"{report['ratio_to_megatron'][name]:>11.3f} {counts:>14} {'' if sent is None else f'{sent:,.0f}':>22}")
    print(f"ideal canzona / sync = {report['ideal_ratio_to_sync']:.3f} (the plan's cost spread evenly, compute "
          f"only); canzona is {report['canzona_speedup_over_megatron']:.2f}x faster than Megatron's layer-wise Muon")


if __name__ == "__main__":
    sys.exit(main())
