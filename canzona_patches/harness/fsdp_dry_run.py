"""``tools/dry_run.py --fsdp``: what one rank of a Megatron-FSDP job holds, predicted from its plan
(the mode's flags, setup, prediction and table; the tool builds the rank's model).

Megatron-FSDP (megatron-core 0.19.2) cannot be built without storage in one process, so this mode
predicts where the DDP mode measures:

* on the meta device it refuses the parameters: building its buffers copies each parameter's
  values into them (``megatron_fsdp/param_and_grad_buffer.py``, ``assert not p.is_meta``);
* on storage-less CPU tensors (torch's ``FakeTensorMode``) the buffers build, but each
  parameter's ``DTensor`` is then checked by all-gathering every rank's shard shape
  (``uneven_dtensor.validate_uneven_dtensor``, ``all_gather_object``): an answer the ``fake``
  process-group backend does not give.

What is built is what the run plans from: the rank's ``GPTModel`` on the meta device under the
fake backend, and the Canzona setup of a ``--use-megatron-fsdp`` run made from it
(``make_setup``, as ``pretrain_gpt.py`` makes it). From that plan alone follow Megatron-FSDP's
buckets (:func:`~megatron.canzona.planning.fsdp.fsdp_buckets`), the rank's part of each buffer
under the sharding strategy, its optimizer state by kind
(:func:`~megatron.canzona.planning.memory.fsdp_state_elements`) and the host-group engine's
buffers of the step (:func:`~megatron.canzona.planning.memory.rank_memory`, as under DDP).
``tests/e2e/test_canzona_fsdp.py`` holds the buckets and every rank's optimizer state to what its
CPU runs measured.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megatron.canzona.planning.fsdp import SHARDING_STRATEGIES, FsdpBucket, fsdp_buckets
from megatron.canzona.planning.geometry import default_bucket_size
from megatron.canzona.planning.grid import expert_coordinates
from megatron.canzona.planning.comm import narrow_gather_bytes
from megatron.canzona.planning.schedule import plan_schedule
from megatron.canzona.planning.memory import (HOLDER_MOMENTUM_OPTIMIZERS, STATE_BYTES, STATE_KINDS, StateLayout,
                                              fsdp_state_elements, rank_memory)

RECIPE_BATCH = dict(global_batch=128, micro_batch=1, seq_length=4096)
"""The Qwen3 recipes' batch (``examples/qwen3/common.sh``): what a CUDA run's
``--canzona-fsdp-micro-groups auto`` is projected with here."""
SHARDED = {"optim": (False, False), "optim_grads": (False, True), "optim_grads_params": (True, True)}
"""Sharding strategy -> (model weights sharded, gradients sharded): Megatron-FSDP's buffers
(``ParamAndGradBuffer``); the fp32 main weights are sharded under each of them."""
BUFFER_ROWS = (  # (key, label, bytes per element: a number or the key of one)
    ("weight_elements", "model weights", "param_dtype_bytes"),
    ("main_weight_elements", "fp32 main weights", STATE_BYTES),
    ("grad_elements", "gradients", "grad_dtype_bytes"),
    ("num_buckets", "buckets", None),
    ("shard_elements", "parameter elements in this rank's shards", None),
)
TEMPORARY_ROWS = (
    ("largest_temporary_elements", "largest temporary buffer of the step", STATE_BYTES),
    ("step_temporary_elements", "host-group buffers alive at once", STATE_BYTES),
    ("compute_batch_elements", "largest host-compute batch (stacked grads)", STATE_BYTES),
    ("early_gather_elements", "early gather buffers (alive from backward)", STATE_BYTES),
    ("early_source_elements", "Muon's sources made in backward (at most)", STATE_BYTES),
)
"""The step's buffers; the early gathers' (every micro-group's, issued in backward) are the ones
the step then uses for its gathers, alive beside backward's last activations: shown, not added
to the peak (as ``tools/dry_run.py`` shows them under DDP); so are the sources Muon's holders make
for them as each bucket reduces (:attr:`~megatron.canzona.planning.memory.RankMemory.early_source_elements`)."""
IN_FLIGHT = {"largest": "largest_temporary_elements", "step": "step_temporary_elements",
             "early_gather": "early_gather_elements"}
"""What every rank's record (``--every-rank``) holds of the step's buffers, by the memory model's
name: what ``tests/e2e/test_canzona_fsdp.py`` compares with the engine's own count on CPU."""
EXPERT = "expert "
"""Label prefix of the expert part's rows (expert buckets over expert DP, the expert optimizer)."""


def add_fsdp_args(p: argparse.ArgumentParser) -> None:
    """``tools/dry_run.py``'s flags of this mode."""
    p.add_argument("--fsdp", "--use-megatron-fsdp", dest="fsdp", action="store_true",
                   help="Megatron-FSDP's buffers instead of DDP's, predicted from the plan (see the top of this help)")
    p.add_argument("--data-parallel-sharding-strategy", dest="strategy", choices=SHARDING_STRATEGIES, default=None,
                   help="with --fsdp: what Megatron-FSDP shards (default optim_grads_params, Megatron's); its "
                   "gradient buffers are in the parameters' dtype (Megatron's --megatron-fsdp-main-grads-dtype auto), "
                   "--grad-reduce-in-fp32 (on in a --bf16 run) sets what the plan prices the gathers in")
    p.add_argument("--every-rank", action="store_true",
                   help="with --fsdp: also every rank's optimizer state by kind (the JSON's 'ranks')")


def check_fsdp_args(p: argparse.ArgumentParser, args: argparse.Namespace, default_layout: str) -> None:
    """What ``--fsdp`` refuses, as ``pretrain_gpt.py`` refuses it under ``--use-megatron-fsdp``
    (``canzona_patches/integration/arguments.py``); expert TP above 1 at EP above 1 is refused by
    the setup, in the run's words."""
    if not args.fsdp:
        for flag, value in (("--data-parallel-sharding-strategy", args.strategy), ("--every-rank", args.every_rank),
                            ("--fsdp-micro-groups", getattr(args, "fsdp_micro_groups", None)),
                            ("--tp-together", getattr(args, "tp_together", None)),
                            ("--narrow-gathers", getattr(args, "narrow_gathers", False))):
            if value:
                p.error(f"{flag} describes Megatron-FSDP: add --fsdp, or drop {flag}")
        return
    together = getattr(args, "tp_together", None)
    if together not in (None, "off") and (args.optimizer != "muon" or args.tp == 1):
        p.error(f"--tp-together {together} computes TP-sharded Muon matrices on their TP ranks together: it needs "
                "--optimizer muon and --tp above 1 (as pretrain_gpt.py): add them, or drop --tp-together")
    if getattr(args, "narrow_gathers", False) and args.optimizer != "muon":
        p.error("--narrow-gathers sends Muon's normalised input to its hosts in bf16 (as pretrain_gpt.py): it needs "
                "--optimizer muon: add it, or drop --narrow-gathers")
    if getattr(args, "narrow_gathers", False) and getattr(args, "muon_fp32_matmul_prec", "medium") == "high":
        p.error("--narrow-gathers sends Muon's normalised input in bf16 (as pretrain_gpt.py): it needs Newton-Schulz "
                "in bf16: drop --muon-fp32-matmul-prec high, or --narrow-gathers")
    if getattr(args, "narrow_gathers", False) is None:  # pretrain_gpt.py's default under Megatron-FSDP
        args.narrow_gathers = args.optimizer == "muon" and getattr(args, "muon_fp32_matmul_prec", "medium") != "high"
    args.strategy = args.strategy or "optim_grads_params"
    # megatron.training resolves the bucket size before Megatron-FSDP sees it, as for DDP (with
    # overlapped reduces, as the recipes run; over DP x CP)
    args.bucket_size = args.bucket_size or default_bucket_size(args.dp * args.cp)
    if args.pp > 1:
        p.error(f"--fsdp with --pp {args.pp}: megatron-core 0.19.2's Megatron-FSDP builds its device mesh over the "
                "whole world, without pipeline stages (pretrain_gpt.py refuses it): drop --pp, or --fsdp")
    if args.layout != default_layout:
        p.error(f"--layout {args.layout} lays out Megatron's DDP buffers; under --fsdp the buckets and shards are "
                "Megatron-FSDP's: drop --layout")


def fsdp_setup(args: argparse.Namespace, model, canzona, *, host_ranks: dict, expert_tp_size: int):
    """The Canzona setup of a Megatron-FSDP run, made from the rank's ``model`` (on meta) as
    ``pretrain_gpt.py`` makes it, before Megatron-FSDP would wrap the model."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from canzona_patches.integration.setup import make_setup
    from megatron.canzona.planning.sim import Workload

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, use_megatron_fsdp=True,
        data_parallel_sharding_strategy=args.strategy, grad_reduce_in_fp32=args.grad_reduce_in_fp32,
        bucket_size=args.bucket_size,
    )
    per_step = args.dp * args.cp * RECIPE_BATCH["micro_batch"]  # the global batch rounded up to DP x micro
    workload = Workload(**{**RECIPE_BATCH, "global_batch": -(-RECIPE_BATCH["global_batch"] // per_step) * per_step})
    # the micro-groups a CUDA run takes (auto: projected with the recipes' batch), as the early compute
    return make_setup([model], ddp_config, canzona, dp_size=args.dp, tp_size=args.tp, ep_size=args.ep,
                      expert_tp_size=expert_tp_size, host_ranks=host_ranks, log=False, workload=workload, cuda=True)


def fsdp_report(args: argparse.Namespace, setup, config: dict, catalog: dict, *, dp_rank: int, tp_rank: int,
                param_bytes: int, build_seconds: float) -> dict:
    """The report of ``tools/dry_run.py --fsdp`` (``--json`` prints it): rank ``(dp_rank, tp_rank)``
    (DP x CP index, TP rank) of ``setup`` (the Canzona setup of a Megatron-FSDP run), ``config``
    the job's record, ``catalog`` the check of the setup's parameters against the catalog's."""
    plan, specs = setup.plan, list(setup.specs)
    state = StateLayout.of(args.optimizer, setup.config.matrix)
    size = param_bytes  # Megatron-FSDP's gradients: the parameters' dtype (--megatron-fsdp-main-grads-dtype auto)
    narrow = gathered_narrow(setup)
    predicted = predict_fsdp(plan, specs, state, dp_rank=dp_rank, tp_rank=tp_rank, strategy=args.strategy,
                             bucket_size=args.bucket_size, param_bytes=size, grad_bytes=size, narrow_gathers=narrow)
    rows = fsdp_rows(predicted, args.strategy)
    experts = predicted["experts"]
    return {
        "config": {**config, "strategy": args.strategy, "fsdp": True,
                   "micro_groups": setup.config.fsdp_micro_groups, "tp_together": setup.config.tp_together,
                   "computed_together": sum(h.together for h in plan.hosts),
                   "narrow_gathers": setup.config.narrow_gathers, "gathered_narrow": len(narrow),
                   "num_groups": len({h.group for h in plan.hosts})},
        "build_seconds": build_seconds,
        "rows": rows,
        "catalog": catalog,
        "state": {"dense": predicted["state_elements"], "experts": experts and experts["state_elements"]},
        "buckets": predicted["bucket_elements"],
        "expert_buckets": experts and experts["bucket_elements"],
        "bucket_geometry": predicted["buckets"] + (experts["buckets"] if experts else []),
        "memory": fsdp_memory(rows),
        "ranks": every_rank_state(plan, specs, state, strategy=args.strategy, bucket_size=args.bucket_size,
                                  narrow_gathers=narrow)
        if args.every_rank else None,
        "measured": False,
        "agree": catalog["ok"],
    }


def _held(bucket: FsdpBucket, rank: int) -> int:
    """Parameter elements (padding not counted) in ``rank``'s shard of ``bucket``."""
    return sum(hi - lo for item in bucket.items for r, lo, hi in bucket.pieces(item) if r == rank)


def part_buffers(buckets: Sequence[FsdpBucket], rank: int, strategy: str) -> dict:
    """What a rank at ``rank`` of the buckets' group holds of their buffers, in elements."""
    weights, grads = SHARDED[strategy]
    return {
        "weight_elements": sum(b.shard_size if weights else b.size for b in buckets),
        "main_weight_elements": sum(b.shard_size for b in buckets),
        "grad_elements": sum(b.shard_size if grads else b.size for b in buckets),
        "num_buckets": len(buckets),
        "shard_elements": sum(_held(b, rank) for b in buckets),
        "bucket_elements": [b.size for b in buckets],
    }


def rank_state(plan, specs, buckets, state: StateLayout, *, dp_rank: int, tp_rank: int, strategy: str,
               bucket_size: int | None) -> dict:
    """The optimizer state by kind of rank ``(dp_rank, tp_rank)`` (DP x CP index, TP rank):
    ``dense`` and, with an expert plan, ``experts`` (at the rank's expert coordinate)."""
    common = dict(state=state, strategy=strategy, bucket_size=bucket_size, buckets={0: buckets})
    out = {"dense": fsdp_state_elements(plan, specs, dp_rank=dp_rank, tp_rank=tp_rank, **common), "experts": None}
    if plan.experts is not None:
        edp, _, etp = expert_coordinates(dp_rank, tp_rank, tp_size=plan.tp_size, ep_size=plan.ep_size,
                                         expert_tp_size=plan.experts.tp_size)
        out["experts"] = fsdp_state_elements(plan, specs, dp_rank=edp, tp_rank=etp, experts=True, **common)
    return out


def gathered_narrow(setup) -> dict[str, int]:
    """Bytes per element of the tasks (dense and expert) whose hosts gather them narrow in
    ``setup``'s run (``--canzona-narrow-gathers``; none without it)."""
    if not setup.config.narrow_gathers:
        return {}
    plans = [setup.plan] + ([setup.plan.experts] if setup.plan.experts is not None else [])
    return {key: size for plan in plans
            for key, size in narrow_gather_bytes(plan_schedule(plan).tasks, setup.specs, setup.config.cost_model()).items()}


def predict_fsdp(plan, specs, state: StateLayout, *, dp_rank: int, tp_rank: int, strategy: str,
                 bucket_size: int | None, param_bytes: int, grad_bytes: int,
                 narrow_gathers: dict[str, int] | None = None) -> dict:
    """Rank ``(dp_rank, tp_rank)``'s buffers, buckets, optimizer state and step buffers under
    Megatron-FSDP, dense and (``experts``) expert, from ``plan`` (of the ``fsdp`` layout) and the
    ``specs`` it was made from; ``narrow_gathers``: :func:`gathered_narrow`."""
    expert_dp = plan.experts.dp_size if plan.experts is not None else None
    buckets = fsdp_buckets(specs, dp_size=plan.dp_size, strategy=strategy, bucket_size=bucket_size,
                           expert_dp_size=expert_dp)
    mem = rank_memory(plan, specs, dp_rank=dp_rank, tp_rank=tp_rank, state=state, early_compute_bytes=0,
                      narrow_gathers=narrow_gathers, holder_sources=state.optimizer in HOLDER_MOMENTUM_OPTIMIZERS)
    kinds = rank_state(plan, specs, buckets, state, dp_rank=dp_rank, tp_rank=tp_rank, strategy=strategy,
                       bucket_size=bucket_size)
    # At EP 1 the experts' buckets (their own, by name) are dense ones, sharded over DP.
    parts: dict = {"dense": ([b for b in buckets if not (b.expert and expert_dp)], dp_rank, mem, kinds["dense"])}
    if plan.experts is not None:
        edp, _, _ = expert_coordinates(dp_rank, tp_rank, tp_size=plan.tp_size, ep_size=plan.ep_size,
                                       expert_tp_size=plan.experts.tp_size)
        parts["experts"] = ([b for b in buckets if b.expert], edp, mem.experts, kinds["experts"])
    out: dict = {"experts": None}
    for name, (mine, rank, memory, part_kinds) in parts.items():
        record = {**part_buffers(mine, rank, strategy), "state_elements": part_kinds,
                  "param_dtype_bytes": param_bytes, "grad_dtype_bytes": grad_bytes,
                  "buckets": [b.to_dict() | {"items": len(b.items)} for b in mine]}
        for key, _, _ in TEMPORARY_ROWS:
            record[key] = getattr(memory, key)
        if name == "dense":
            out.update(record)
        else:
            out["experts"] = record
    return out


def every_rank_state(plan, specs, state: StateLayout, *, strategy: str, bucket_size: int | None,
                     narrow_gathers: dict[str, int] | None = None) -> list[dict]:
    """Each rank of the stage (global rank in Megatron's order, PP 1): its optimizer state by kind,
    and the step's buffers (``in_flight``: :data:`IN_FLIGHT`), dense and expert."""
    expert_dp = plan.experts.dp_size if plan.experts is not None else None
    buckets = fsdp_buckets(specs, dp_size=plan.dp_size, strategy=strategy, bucket_size=bucket_size,
                           expert_dp_size=expert_dp)
    out = []
    for dp_rank in range(plan.dp_size):
        for tp_rank in range(plan.tp_size):
            mem = rank_memory(plan, specs, dp_rank=dp_rank, tp_rank=tp_rank, state=state, early_compute_bytes=0,
                              narrow_gathers=narrow_gathers,
                              holder_sources=state.optimizer in HOLDER_MOMENTUM_OPTIMIZERS)
            in_flight = {part: memory and {name: getattr(memory, key) for name, key in IN_FLIGHT.items()}
                         for part, memory in (("dense", mem), ("experts", mem.experts))}
            out.append({"rank": tp_rank + plan.tp_size * dp_rank, "in_flight": in_flight,
                        **rank_state(plan, specs, buckets, state, dp_rank=dp_rank, tp_rank=tp_rank,
                                     strategy=strategy, bucket_size=bucket_size)})
    return out


def _row(label: str, elements: int, size: int | None, held: str = "") -> dict:
    return {"quantity": label, "predicted": elements, "bytes": None if size is None else elements * size, "held": held}


def fsdp_rows(predicted: dict, strategy: str) -> list[dict]:
    """One row per quantity: each part's buffers, the optimizer state of both, each part's step buffers."""
    weights, grads = SHARDED[strategy]
    held = {"weight_elements": "shard" if weights else "whole", "main_weight_elements": "shard",
            "grad_elements": "shard" if grads else "whole"}
    parts = [(predicted, "")] + ([(predicted["experts"], EXPERT)] if predicted["experts"] else [])

    def rows(specs: tuple) -> list[dict]:
        return [_row(prefix + label, part[key], part[per] if isinstance(per, str) else per, held.get(key, ""))
                for part, prefix in parts for key, label, per in specs]

    state = [_row(f"optimizer state: {kind.replace('_', ' ')}", sum(p["state_elements"][kind] for p, _ in parts),
                  STATE_BYTES) for kind in STATE_KINDS]
    return rows(BUFFER_ROWS) + state + rows(TEMPORARY_ROWS)


def fsdp_memory(rows: list[dict]) -> dict:
    """Steady-state and peak bytes: buffers and state between steps; the step adds the larger
    part's host-group buffers and stacked batch (the dense and the expert optimizer step in turn)."""
    by_name = {row["quantity"]: row["bytes"] or 0 for row in rows}
    steady = sum(by_name.get(prefix + label, 0) for prefix in ("", EXPERT) for _, label, _ in BUFFER_ROWS)
    steady += sum(v for k, v in by_name.items() if k.startswith("optimizer state: "))
    peak = steady + max(sum(by_name.get(prefix + label, 0) for _, label, _ in TEMPORARY_ROWS[1:3])
                        for prefix in ("", EXPERT))
    return {"steady_bytes": steady, "peak_bytes": peak, "peak_over_steady": peak / steady if steady else 0.0}


def _gib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**30:.3f} GiB"


def print_fsdp_report(report: dict, rank: str) -> None:
    """The table of :func:`fsdp_report`, as ``tools/dry_run.py`` prints the DDP one; ``rank`` names
    the job and the rank."""
    print(f"[canzona] dry run under Megatron-FSDP ({report['config']['strategy']}): {rank}, planned in "
          f"{report['build_seconds']:.1f} s")
    width = max(44, *(len(row["quantity"]) + 2 for row in report["rows"]))
    print(f"{'':2}{'quantity':<{width}}{'held':>6}{'predicted':>16}{'bytes':>14}")
    for row in report["rows"]:
        print(f"  {row['quantity']:<{width}}{row['held']:>6}{row['predicted']:>16,}{_gib(row['bytes']):>14}")
    for label, buckets in (("buckets", report["buckets"]), ("expert buckets", report["expert_buckets"])):
        if buckets:
            print(f"{label}: {len(buckets)}, largest {max(buckets):,} elements, smallest {min(buckets):,} "
                  f"(padded to DP x chunk)")
    memory = report["memory"]
    print(f"memory: {_gib(memory['steady_bytes'])} between steps, peak {_gib(memory['peak_bytes'])} in the "
          f"optimizer step ({memory['peak_over_steady']:.3f}x; Megatron-FSDP's own unsharded buckets in flight and "
          "the update functions' working set come on top)")
    groups = report["config"]["num_groups"]
    setting = report["config"]["micro_groups"]
    how = " (as a CUDA run projects them at the recipes' batch, 128 x 4,096)" if setting == "auto" else ""
    print(f"micro-groups: {groups}, --fsdp-micro-groups {setting}{how}")
    if report["config"]["tp_together"] != "off":
        print(f"computed by their TP ranks together: {report['config']['computed_together']} matrices "
              f"(--tp-together {report['config']['tp_together']}; each rank's host buffers are its own shard's)")
    if report["config"]["narrow_gathers"]:
        print(f"gathered in bf16: {report['config']['gathered_narrow']} matrices (narrow gathers, the default; their "
              "hosts hold the normalised input in bf16; --no-narrow-gathers: fp32)")
    if report.get("ranks"):
        totals = [(sum(sum(part.values()) for part in (r["dense"], r["experts"] or {}) if part) * STATE_BYTES, r["rank"])
                  for r in report["ranks"]]
        busiest = max(totals)
        print(f"optimizer state over the stage's {len(totals)} ranks: busiest {_gib(busiest[0])} (rank {busiest[1]}), "
              f"mean {_gib(sum(t for t, _ in totals) // len(totals))}")
    print("predicted from the plan (Megatron-FSDP is not built without storage: canzona_patches/harness/fsdp_dry_run.py); "
          "tests/e2e/test_canzona_fsdp.py holds it to CPU runs" if report["agree"] else
          "DISAGREE: the plan's parameters are not the catalog's")
