"""Canzona's command-line flags for ``pretrain_gpt.py``, in Megatron-LM's naming style.

:func:`add_canzona_args` is an ``extra_args_provider`` for
``megatron.training.arguments.parse_args``: it adds an argument group ``canzona`` and
extends the choices of Megatron's own ``--optimizer`` with ``shampoo`` (0.19.2 already
accepts ``muon`` and ``soap``). Muon keeps Megatron's ``--muon-*`` flags (momentum,
``--muon-nesterov``, ``--muon-num-ns-steps``, ``--muon-scale-mode``,
``--muon-coefficient-type``, ``--muon-extra-scale-factor``, ``--muon-no-split-qkv``).

:func:`validate_canzona_args` runs *before* Megatron's ``validate_args`` (whose asserts
would otherwise answer first, with a traceback) and raises
:class:`CanzonaArgumentError` with a one-line message that names the fix.
:func:`finalize_canzona_args` runs after ``validate_args``: it undoes the one rewrite of
Megatron's that contradicts Canzona, and gives ``--rampup-batch-size``, which Megatron-Core
0.19.2 parses but ignores, its effect (see their docstrings).

Hooks (megatron-core 0.19.2): ``megatron.training.arguments.parse_args`` (the parser it
hands to ``extra_args_provider``) and ``validate_args`` (arguments.py:1669-1682, the
emerging-optimizer rewrite of ``--use-distributed-optimizer``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.util
import os
import re
import typing
from collections.abc import Callable
from typing import Any

from canzona_patches.errors import CanzonaArgumentError
from canzona_patches.integration.dependent_flags import check_dependent_flags
from canzona_patches.integration.optimizer_ranges import check_megatron_optimizer_ranges, field_error_line
from canzona_patches.integration.qk_clip import check_qk_clip_args, hold_qk_clip_args, restore_qk_clip_args
from canzona_patches.version import require_pinned_megatron

require_pinned_megatron()

from megatron.canzona.data import check_blend_words, check_tokenizer_model  # noqa: E402
from megatron.canzona.optim import AdaptiveMuonConfig, MuonConfig, ShampooConfig, SOAPConfig  # noqa: E402
from megatron.canzona.optim.config import FieldError  # noqa: E402
from megatron.canzona.planning import OPTIMIZERS  # noqa: E402  (--canzona accepts exactly these)
from megatron.canzona.planning.balance import TP_TOGETHER  # noqa: E402
from megatron.canzona.planning.cost import NS_OPTIMIZERS  # noqa: E402
from megatron.canzona.planning.speculation import EARLY_COMPUTE_SETTINGS  # noqa: E402
from megatron.canzona.runtime.config import COSTS, FSDP_MICRO_GROUPS, LAYOUT_CHOICES, TP_MODES, CanzonaConfig  # noqa: E402
from megatron.training.argument_utils import ArgumentGroupFactory  # noqa: E402

CANZONA_ONLY_OPTIMIZERS = ("shampoo",)
"""Choices of ``--optimizer`` that only Canzona implements (Megatron 0.19.2 has no Shampoo)."""

CANZONA_FLAG_FIELDS = ("alpha", "cost", "split_qkv", "split_qkv_per_head", "split_gate_up", "tp_mode", "tp_group_budget", "early_gather",
                       "layout", "cluster", "fsdp_micro_groups", "tp_together")
"""The fields of ``CanzonaConfig`` that a ``--canzona-<field>`` flag sets (``dest`` ``canzona_<field>``) as
it is (``narrow_gathers`` has a default of its own: :func:`narrow_gathers_of`)."""


def add_canzona_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider``: add the ``canzona`` group and ``--optimizer shampoo``."""
    _extend_optimizer_choices(parser, CANZONA_ONLY_OPTIMIZERS)
    # Megatron's usage line lists every one of its ~900 flags and argparse prints it before
    # each error, burying the one line that names the fix: keep the error line alone.
    parser.usage = "%(prog)s [Megatron-LM flags] [Canzona flags]"
    parser.error = functools.partial(_one_line_error, parser)
    _add_canzona_core_args(parser.add_argument_group(title="canzona"))
    # A field of Megatron-Core's OptimizerConfig without a flag of its own in 0.19.2 (training
    # copies every parsed flag named after a field into the config).
    parser.add_argument("--grad-norm-skip-threshold", type=float, default=float("inf"), metavar="NORM",
                        help="Skip the optimizer step of an iteration whose global gradient norm is above NORM "
                        "(Megatron-Core's OptimizerConfig.grad_norm_skip_threshold; its chained optimizers honour "
                        "it, and so does every Canzona optimizer, which then drops what it computed early). "
                        "Default: never.")
    for flags in MATRIX_FLAGS.values():
        flags.build_group(parser, title=f"canzona {flags.prefix}")
    return parser


def reports_errors() -> bool:
    """Whether this process prints a start-up error: rank 0 of a torchrun job, or a process
    not started by torchrun. Every rank parses the same flags and fails alike, so the job
    says it once; the other ranks exit quietly with the same code."""
    return os.environ.get("RANK", "0") == "0"


def _one_line_error(parser: argparse.ArgumentParser, message: str) -> None:
    parser.exit(2, f"{parser.prog}: error: {message}\n" if reports_errors() else None)


def _extend_optimizer_choices(parser: argparse.ArgumentParser, extra: tuple[str, ...]) -> None:
    # Extend Megatron's own --optimizer rather than adding a second flag for the same thing.
    for action in parser._actions:  # argparse keeps its actions only in this private list
        if "--optimizer" in action.option_strings:
            action.choices = list(action.choices) + [c for c in extra if c not in action.choices]
            return
    raise RuntimeError("Megatron's parser has no --optimizer flag; is megatron-core 0.19.2 installed?")


def _add_canzona_core_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--canzona", action="store_true",
                       help="Partition the matrix optimizer (--optimizer muon|shampoo|soap|adaptive_muon) over "
                       "DP and TP ranks with Canzona (needs --use-distributed-optimizer).")
    defaults = CanzonaConfig  # one set of defaults: the config's
    group.add_argument("--canzona-alpha", type=float, default=defaults.alpha,
                       help="Balance weight in [0, 1]: 0 favours the fewest bytes sent per rank (padding "
                       "and gathers of matrices split across DP shards), 1 equal optimizer compute per rank.")
    group.add_argument("--canzona-cost", choices=COSTS, default=defaults.cost,
                       help="What is balanced across ranks: the optimizer's FLOPs per matrix or "
                       "its element count.")
    group.add_argument("--canzona-layout", choices=LAYOUT_CHOICES, default=defaults.layout,
                       help="DP layout of the matrix buffers: whole = every matrix whole in one DP rank's "
                       "shard, shards of variable size (no DP traffic in the optimizer step); lean = "
                       "Megatron's equal shards, matrices across a shard boundary gathered to a host in "
                       "the step; auto = the one projected faster on --canzona-cluster (default).")
    group.add_argument("--canzona-cluster", type=str, default=defaults.cluster,
                       help="Cluster the auto layout is projected on: a preset (h100-ib400, h800-ib400, "
                       "gb300-nvl72, ...) or a TOML/JSON file (tools/simulate.py's schema). Default: "
                       "h100-ib400 on CUDA, this machine's gloo probe on CPU.")
    switch = functools.partial(_add_switch, group)
    switch("split-qkv", defaults.split_qkv,
           on="Treat Q, K and V of the fused QKV weight as separate matrices (default, as Megatron's Muon).",
           off="Treat the fused QKV weight as one matrix.")
    group.add_argument("--canzona-split-qkv-per-head", action="store_true", default=defaults.split_qkv_per_head,
                       help="Treat every attention head's query, key and value block of the fused QKV weight as "
                       "its own matrix (Megatron's --muon-split-qkv splits Q, K and V only).")
    switch("split-gate-up", defaults.split_gate_up,
           on="Treat gate and up halves of the fused SwiGLU fc1 weight as separate matrices, each its own "
           "task with its own host (under TP, two TP ranks of the owner compute them side by side).",
           off="Treat the fused fc1 weight as one matrix (default).")
    switch("stagger-refresh", ShampooConfig.stagger_refresh,  # Shampoo's and SOAP's alike
           on="Refresh each Shampoo/SOAP preconditioner from an offset per matrix, taken from its name "
           "(default), so refreshes spread over steps.",
           off="Refresh every Shampoo/SOAP preconditioner in the same steps (1, 1+f, ...).")
    group.add_argument("--canzona-tp-mode", choices=TP_MODES, default=defaults.tp_mode,
                       help="How matrices that cross ranks are updated: async = one host rank per matrix "
                       "with pipelined micro-grouped all-to-alls; sync = every rank holding a piece "
                       "gathers and computes it (synchronous-compute baseline).")
    switch("early-gather", defaults.early_gather,
           on="Issue the host-group gathers as each bucket's gradients finish reducing, so they overlap "
           "the rest of backward (default).",
           off="Issue the host-group gathers in the optimizer step.")
    group.add_argument("--canzona-early-compute", nargs="?", choices=EARLY_COMPUTE_SETTINGS, const="on",
                       default=defaults.early_compute, metavar="{auto,on,off}",
                       help="Compute each micro-group's matrix updates before the step, once its early gather has "
                       "landed and backward is over (on CUDA on a side stream, in the reduce-scatters' tail), "
                       "speculating that the clip does not act; the step uses them unless the clip acts (then it "
                       "computes them again) or the step is skipped: bitwise the same. auto (default): where the "
                       "run has a reduce-scatter tail to hide it in (CUDA, data-parallel size above 1, "
                       "--overlap-grad-reduce), and only in iterations where the clip is likely idle (not after it "
                       "acted; backing off after repeated misses). on (the flag alone): wherever the early gathers "
                       "run, gloo and DP 1 included. off: never.")
    group.add_argument("--canzona-no-early-compute", action="store_const", const="off", dest="canzona_early_compute",
                       help="Compute every matrix update in the optimizer step (--canzona-early-compute off).")
    switch("matrices-reduce-first", None,
           on="With early compute: reduce the gradients of the output layer and the norms after the last bucket "
           "holding a matrix, so the matrices reach their hosts earlier in the reduce-scatters' tail and their "
           "updates are computed beside the rest of it; bitwise the same. Default: where the iteration is "
           "projected shorter on --canzona-cluster.",
           off="Reduce every bucket as soon as backward has produced its gradients (Megatron's order).")
    group.add_argument("--canzona-early-compute-budget", type=float, default=defaults.early_compute_bytes / 2**30,
                       metavar="GIB",
                       help="Most GiB early compute keeps per rank (the matrices' updates until the step, and for "
                       "Shampoo and SOAP a staging copy of their state): the micro-groups whose buckets reduce first and "
                       "fit are computed early, the others in the step. tools/dry_run.py shows what a rank keeps.")
    group.add_argument("--canzona-tp-group-budget", type=float, default=defaults.tp_group_budget,
                       help="Most cost one host takes in one micro-group (default: about a quarter of "
                       "the busiest host's work, two groups at least on a host with two matrices).")
    group.add_argument("--canzona-fsdp-micro-groups", choices=FSDP_MICRO_GROUPS, default=defaults.fsdp_micro_groups,
                       help="Under --use-megatron-fsdp: one = every matrix in one micro-group, its gathers one "
                       "all-to-all during backward; budget = the planner's groups (--canzona-tp-group-budget); "
                       "auto (default) = one where the slower of its iterations projected on --canzona-cluster, the "
                       "clip idle and acting every iteration, is faster than the budget's, on CUDA with the early "
                       "gathers (a [canzona] micro-groups line says which), else budget. Bitwise the same either way.")
    group.add_argument("--canzona-tp-together", choices=TP_TOGETHER, default=defaults.tp_together,
                       help="Under --use-megatron-fsdp with --optimizer muon and TP: the TP-sharded matrices whose "
                       "TP ranks compute them together, each gathering and computing its own shard, their "
                       "Newton-Schulz summing the shards' Gram matrices over the TP group (equal to one host's to "
                       "rounding, not bitwise): auto = those whose update alone costs more than the mean per GPU "
                       "(Qwen3-32B's fc1 and fc2), all = every one whose TP-split side is its long one, off "
                       "(default) = one host per matrix.")
    switch("exact-norm", None,
           on="Muon (and AdaMuon, NorMuon) divide Newton-Schulz's input by its Frobenius norm summed in integers: "
           "the same bits however the matrix is cut among ranks, so every layout, the distributed optimizer's and "
           "Megatron-FSDP's, makes the same update from the same gradients bit for bit (within n * 2**-60 of the "
           "exact norm, n elements). "
           "Default: under --use-megatron-fsdp, whose holders divide their pieces by it (--canzona-narrow-gathers).",
           off="Take torch's fp32 norm of the whole matrix on its host (default under --use-distributed-optimizer: "
           "the exact one costs a few passes over each matrix's memory).")
    switch("narrow-gathers", None,
           on="Under --use-megatron-fsdp with --optimizer muon (Newton-Schulz in bf16, the default "
           "--muon-fp32-matmul-prec medium; --canzona-tp-mode async): each whole matrix's holders send its "
           "Newton-Schulz input to its host divided by the matrix's Frobenius norm, in bf16, half the gathers' bytes; "
           "the norm is --canzona-exact-norm's, summed in integers (two all-reduces of a few bytes per micro-group), "
           "so the run is bitwise the same as without it. Default: wherever those hold.",
           off="Send the pieces to their hosts in fp32, as the holders keep them; the host normalises them.")
    switch("checksums", True,
           on="Record a SHA-256 of every checkpoint file as it is written, and verify them (spread over the "
           "ranks) before a load (default); a corrupt file is named in one line.",
           off="Neither record nor verify checkpoint checksums.")
    group.add_argument("--canzona-metrics-file", type=str, default=None,
                       help="Append one JSON line per --log-interval (iteration, loss, grad norm, "
                       "learning rate, optimizer step time, tokens/s) to this file; plot with "
                       "tools/plot_loss.py.")
    group.add_argument("--canzona-calibration", type=str, default=None, metavar="FILE",
                       help="Newton-Schulz timings of this machine (tools/bench_optim.py --muon-ns-method standard "
                       "gram --calibrate FILE): --muon-ns-method auto takes, per shape measured, the method measured "
                       "faster. Default: tools/calibrations/h100-muon-bf16.json on CUDA, none on CPU; 'none': the "
                       "FLOP rule everywhere.")
    group.add_argument("--canzona-profile-iteration", type=int, default=None, metavar="N",
                       help="Run iteration N (as the log numbers it) under torch.profiler and print where its "
                       "time goes: CPU and GPU time and host syncs by owner (model, Megatron DDP, Canzona's "
                       "hooks, optimizer), and the GPU's idle time inside forward-backward. Any optimizer.")
    group.add_argument("--canzona-profile-file", type=str, default=None,
                       help="With --canzona-profile-iteration: also write the summary as JSON here.")


def _add_switch(group: argparse._ArgumentGroup, name: str, default: bool, *, on: str, off: str) -> None:
    """``--canzona-<name>`` and ``--canzona-no-<name>``, both setting ``canzona_<name>``."""
    dest = f"canzona_{name.replace('-', '_')}"
    group.add_argument(f"--canzona-{name}", action="store_true", dest=dest, default=default, help=on)
    group.add_argument(f"--canzona-no-{name}", action="store_false", dest=dest, help=off)


class ConfigFlags(ArgumentGroupFactory):
    """The flags of one matrix optimizer's config dataclass, made by Megatron's
    ``ArgumentGroupFactory`` from its fields (type, default, docstring as help): field ``f``
    becomes ``--<prefix>-f`` (``dest`` ``<prefix>_f``), or ``--<prefix>-<renames[f]>``. A pair
    field (``betas``) becomes one flag per element, named by ``renames[f]``."""

    def __init__(self, config_class: type, prefix: str, *, renames: dict[str, Any] | None = None,
                 exclude: tuple[str, ...] = ()) -> None:
        fields = [f for f in dataclasses.fields(config_class) if f.init and f.name not in exclude]
        self.pairs = [f for f in fields if isinstance(f.default, tuple)]
        """Fields the factory cannot type (a tuple): one flag per element, added by :meth:`build_group`."""
        self.singles = [f for f in fields if not isinstance(f.default, tuple)]
        """Fields the factory makes one flag of."""
        super().__init__(config_class, exclude=[*exclude, *(f.name for f in self.pairs)])
        self.prefix, self.renames = prefix, dict(renames or {})

    def _flag_name(self, name: str) -> str:
        return f"{self.prefix}_{self.renames.get(name, name)}"

    def _format_arg_name(self, config_attr_name: str, prefix: str | None = None) -> str:
        return super()._format_arg_name(self._flag_name(config_attr_name), prefix)

    def _build_argparse_kwargs_from_field(self, attribute: Any) -> dict[str, Any]:
        attribute = copy.copy(attribute)  # its annotation evaluated (the config module postpones them)
        attribute.type = typing.get_type_hints(self.src_cfg_class)[attribute.name]
        kwargs = super()._build_argparse_kwargs_from_field(attribute)
        kwargs["dest"] = self._flag_name(attribute.name)
        kwargs["help"] = f"{self.src_cfg_class.__name__.removesuffix('Config')}: {kwargs['help']}"
        return kwargs

    def build_group(self, parser: argparse.ArgumentParser, title: str | None = None) -> argparse._ArgumentGroup:
        group = super().build_group(parser, title)
        group.description = None  # the class docstring: the help's group title says enough
        for field in self.pairs:
            doc = self.field_docstrings.get(field.name, "")
            for index, (name, default) in enumerate(zip(self.renames[field.name], field.default)):
                group.add_argument(f"--{self.prefix}-{name}".replace("_", "-"), dest=f"{self.prefix}_{name}",
                                   type=type(default), default=default,
                                   help=f"{self.src_cfg_class.__name__.removesuffix('Config')}: element {index} of "
                                   f"{field.name}: {doc}".replace("%", "%%"))
        return group

    def config(self, args: argparse.Namespace, **given: Any) -> Any:
        """The config dataclass the parsed flags describe (``given`` fields as passed)."""
        values = {f.name: getattr(args, self._flag_name(f.name)) for f in self.singles}
        values |= {f.name: tuple(getattr(args, f"{self.prefix}_{n}") for n in self.renames[f.name]) for f in self.pairs}
        return self.src_cfg_class(**{**values, **given})


# Every field but the refresh stagger (--canzona-no-stagger-refresh, shared by both). SOAP's
# shampoo beta and preconditioner frequency also reach Megatron's own emerging-optimizers SOAP
# through OptimizerConfig fields of the same names (soap_shampoo_beta, soap_precondition_frequency).
MATRIX_FLAGS = {
    # Muon's other fields are Megatron's own --muon-* flags (canzona_config_from_args).
    "muon": ConfigFlags(MuonConfig, "muon", exclude=tuple(f.name for f in dataclasses.fields(MuonConfig)
                                                          if f.name != "ns_method")),
    "shampoo": ConfigFlags(ShampooConfig, "shampoo", exclude=("stagger_refresh",),
                           renames={"momentum": "beta1", "shampoo_beta": "beta2", "eps": "epsilon"}),
    "soap": ConfigFlags(SOAPConfig, "soap", exclude=("stagger_refresh",), renames={"betas": ("beta1", "beta2")}),
    # Megatron-Core 0.19.2's OptimizerConfig fields adaptive_muon_{moment2_method,beta2,eps}, which it
    # gives no flags; the rest of AdaMuon's and NorMuon's settings are Muon's.
    "adaptive_muon": ConfigFlags(AdaptiveMuonConfig, "adaptive_muon", renames={"moment2_eps": "eps"},
                                 exclude=tuple(f.name for f in dataclasses.fields(MuonConfig))),
}
"""The Shampoo and SOAP flags, Muon's ``--muon-ns-method`` and the adaptive Muons' second moment,
generated from their config dataclasses (Muon's other settings are Megatron's ``--muon-*`` flags)."""
MATRIX_FLAG_OWNERS = {"shampoo": "is a Shampoo setting", "soap": "is a SOAP setting",
                      "adaptive_muon": "sets AdaMuon's and NorMuon's second moment"}
"""The optimizers whose generated flags (``--<optimizer>-*``) need ``--optimizer <optimizer>``, and
what such a flag is, in the refusal's words. (SOAP's shampoo beta and preconditioner frequency
reach Megatron's own SOAP too, which ``--optimizer soap`` runs without ``--canzona``.)"""
EVERY_RUN_FLAGS = ("--canzona-metrics-file", "--canzona-profile-iteration", "--canzona-profile-file",
                   "--canzona-checksums", "--canzona-no-checksums")
"""Flags of the ``canzona`` group that act on every run, with ``--canzona`` or without (the metrics
file, the profiled iteration, checkpoint checksums); every other flag of the group needs ``--canzona``."""


@functools.cache
def flag_groups() -> dict[str, tuple[argparse.Action, ...]]:
    """The actions of each argument group :func:`add_canzona_args` adds (``canzona``, ``canzona
    shampoo``, ...), by title, read from a parser it builds: a flag added to a group is checked
    by :func:`given_flags` without a list to keep."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--optimizer", choices=["adam"])  # the Megatron flag add_canzona_args extends
    add_canzona_args(parser)
    return {group.title: tuple(group._group_actions) for group in parser._action_groups  # argparse keeps them so
            if group.title and group.title.startswith("canzona")}


def given_flags(args: argparse.Namespace, title: str) -> list[str]:
    """The flags of group ``title`` whose values differ from their defaults in ``args``, as the
    command line spells them (a switch by its name, a value after its flag)."""
    actions = flag_groups()[title]
    given = []
    for dest in dict.fromkeys(action.dest for action in actions):
        same = [a for a in actions if a.dest == dest]
        value = getattr(args, dest, same[0].default)
        if value is same[0].default or value == same[0].default:
            continue
        switch = next((a for a in same if a.nargs == 0 and a.const == value), None)
        flag = switch.option_strings[0] if switch else next(a for a in same if a.nargs != 0).option_strings[0]
        given.append(flag if switch else f"{flag} {value}")
    return given


def _check_flags_have_their_run(args: argparse.Namespace) -> None:
    """Each optimizer's generated flags only with that optimizer, and Canzona's flags only with
    ``--canzona`` (but :data:`EVERY_RUN_FLAGS`): anywhere else they would do nothing."""
    for optimizer, what in MATRIX_FLAG_OWNERS.items():
        given = given_flags(args, f"canzona {optimizer}")
        if given and args.optimizer != optimizer:
            flag = given[0].split()[0]
            raise CanzonaArgumentError(f"{flag} {what}: pass --optimizer {optimizer}, or drop {flag}")
    if args.canzona:
        return
    given = [flag for flag in given_flags(args, "canzona") if flag.split()[0] not in EVERY_RUN_FLAGS]
    if given:
        raise CanzonaArgumentError(
            f"{given[0]} does nothing without --canzona (Megatron's optimizer runs and never reads it): add --canzona "
            f"(with --use-distributed-optimizer), or drop {given[0].split()[0]}")


def validate_canzona_args(args: argparse.Namespace) -> None:
    """Check the Canzona flags against the rest; raise :class:`CanzonaArgumentError` if bad.

    Runs before Megatron's ``validate_args``, on the parsed flags as given.
    """
    _check_flags_have_their_run(args)
    check_dependent_flags(args)
    check_common_args(args)
    check_qk_clip_args(args)
    if args.optimizer in CANZONA_ONLY_OPTIMIZERS and not args.canzona:
        raise CanzonaArgumentError(
            f"--optimizer {args.optimizer} is implemented by Canzona only: add --canzona "
            "(with --use-distributed-optimizer)")
    if args.muon_ns_method != "standard" and not (args.canzona and args.optimizer in NS_OPTIMIZERS):
        raise CanzonaArgumentError(
            f"--muon-ns-method {args.muon_ns_method} is Canzona's Muon: add --canzona with --optimizer muon, "
            "or drop --muon-ns-method")
    if args.optimizer == "adaptive_muon" and not args.canzona:
        raise CanzonaArgumentError(
            "--optimizer adaptive_muon without --canzona runs Megatron-Core 0.19.2's TensorParallelAdaptiveMuon, which "
            "stops at its first step (it never sets the scale_mode its step reads): add --canzona "
            "(with --use-distributed-optimizer)")
    if not args.canzona:
        return
    if args.optimizer not in OPTIMIZERS:
        raise CanzonaArgumentError(
            f"--canzona needs a matrix optimizer: pass --optimizer {'|'.join(OPTIMIZERS)} "
            f"(not {args.optimizer})")
    if args.canzona_split_qkv_per_head and not args.canzona_split_qkv:
        raise CanzonaArgumentError(
            "--canzona-split-qkv-per-head splits Q, K and V into their heads, and --canzona-no-split-qkv keeps "
            "the fused QKV weight one matrix: drop one")
    if getattr(args, "use_torch_fsdp2", False):
        raise CanzonaArgumentError(
            "--canzona does not work with --use-torch-fsdp2 (its per-parameter shards are not bound to a plan): "
            "use --use-megatron-fsdp, or --use-distributed-optimizer")
    if args.optimizer_cpu_offload:
        raise CanzonaArgumentError(
            "--canzona does not work with --optimizer-cpu-offload (the matrix update runs on "
            "the owning rank's device): drop --optimizer-cpu-offload")
    fsdp = getattr(args, "use_megatron_fsdp", False)
    if args.canzona_fsdp_micro_groups != "auto" and not fsdp:
        raise CanzonaArgumentError(
            f"--canzona-fsdp-micro-groups {args.canzona_fsdp_micro_groups} groups the matrices under "
            "--use-megatron-fsdp; the distributed optimizer's groups follow --canzona-tp-group-budget: drop "
            "--canzona-fsdp-micro-groups")
    if args.canzona_tp_together != "off":
        unread = ("--use-megatron-fsdp" if not fsdp else "--optimizer muon" if args.optimizer != "muon"
                  else "--tensor-model-parallel-size above 1" if args.tensor_model_parallel_size == 1
                  else "--canzona-tp-mode async" if args.canzona_tp_mode != "async" else None)
        if unread is not None:
            raise CanzonaArgumentError(
                f"--canzona-tp-together {args.canzona_tp_together} computes TP-sharded Muon matrices on their TP "
                f"ranks together under Megatron-FSDP; it needs {unread}: add that, or drop --canzona-tp-together")
    if args.canzona_exact_norm and args.optimizer not in MUON_FAMILY:
        raise CanzonaArgumentError(
            f"--canzona-exact-norm normalises Newton-Schulz's input of Muon, AdaMuon and NorMuon; --optimizer "
            f"{args.optimizer} has none: drop --canzona-exact-norm")
    if args.canzona_narrow_gathers:
        unread = ("--use-megatron-fsdp" if not fsdp else "--optimizer muon" if args.optimizer != "muon"
                  else "--muon-fp32-matmul-prec medium (Newton-Schulz in bf16)" if args.muon_fp32_matmul_prec == "high"
                  else "--canzona-tp-mode async" if args.canzona_tp_mode != "async"
                  else "--canzona-exact-norm" if not exact_norm_of(args) else None)
        if unread is not None:
            raise CanzonaArgumentError(
                f"--canzona-narrow-gathers sends Muon's normalised Newton-Schulz input to its hosts in bf16 under "
                f"Megatron-FSDP; it needs {unread}: add that, or drop --canzona-narrow-gathers")
    if args.canzona_fsdp_micro_groups == "one" and args.canzona_tp_group_budget is not None:
        raise CanzonaArgumentError(
            "--canzona-fsdp-micro-groups one puts every matrix in one micro-group, and --canzona-tp-group-budget "
            "caps a host's cost per group: drop one")
    if fsdp:
        _check_megatron_fsdp(args)
    elif not args.use_distributed_optimizer:
        raise CanzonaArgumentError(
            "--canzona partitions the distributed optimizer: add --use-distributed-optimizer")
    _check_parallelism(args)
    _check_optimizer_flags(args)
    if args.save and args.ckpt_format != "torch_dist" and not fsdp:
        raise CanzonaArgumentError(
            f"--ckpt-format {args.ckpt_format} cannot hold --canzona's optimizer state (a global tensor per "
            "parameter name, resharded at load), and the first save would stop the job: pass --ckpt-format "
            "torch_dist (the default)")
    _check_ranges(args)
    _check_optimizer_settings(args)
    _check_cluster(args)
    hold_qk_clip_args(args)  # past Megatron's transformer-engine assert; finalize_canzona_args restores
    if fsdp:  # past Megatron-FSDP's "sgd or adam" assert; finalize_canzona_args restores it
        _HELD_OPTIMIZER[id(args)] = args.optimizer
        args.optimizer = "adam"


_HELD_OPTIMIZER: dict[int, str] = {}
"""``--optimizer`` of a ``--canzona --use-megatron-fsdp`` run while Megatron's ``validate_args``
runs (which allows only sgd and adam under Megatron-FSDP, for its own optimizers)."""


FSDP_REFUSED = (
    ("canzona_matrices_reduce_first", bool, "--canzona-matrices-reduce-first",
     "Megatron-FSDP orders its own reduce-scatters"),
)
"""What ``--canzona --use-megatron-fsdp`` does not run yet: (flag's dest, when it is set, how it
is written, why)."""


def _check_megatron_fsdp(args: argparse.Namespace) -> None:
    """``--canzona --use-megatron-fsdp``: the plan is bound to Megatron-FSDP's own buckets and shards
    (every sharding strategy that shards), so the flags that choose or reorder Canzona's DDP layout
    do not apply, and what is not built under it yet is refused in one line naming the flag."""
    strategy = args.data_parallel_sharding_strategy
    if strategy == "no_shard":
        raise CanzonaArgumentError(
            "--canzona --use-megatron-fsdp with --data-parallel-sharding-strategy no_shard has no shards to bind (every "
            "rank holds every matrix): pass optim, optim_grads or optim_grads_params, or --use-distributed-optimizer")
    if args.canzona_layout != "auto":
        raise CanzonaArgumentError(
            f"--canzona-layout {args.canzona_layout} lays out Megatron's DDP buffers; under --use-megatron-fsdp the "
            "buckets and shards are Megatron-FSDP's: drop --canzona-layout")
    if args.num_distributed_optimizer_instances > 1:
        raise CanzonaArgumentError(
            f"--num-distributed-optimizer-instances {args.num_distributed_optimizer_instances} splits Megatron's "
            "distributed optimizer; Megatron-FSDP's replica across groups is its hybrid sharding "
            "(--outer-dp-sharding-strategy): drop --num-distributed-optimizer-instances, or use "
            "--use-distributed-optimizer")
    for dest, is_set, flag, why in FSDP_REFUSED:
        value = getattr(args, dest, None)
        if value is not None and is_set(value):
            raise CanzonaArgumentError(
                f"--canzona --use-megatron-fsdp does not run with {flag.format(v=value)} yet ({why}): drop "
                f"{flag.split()[0]}, or use --use-distributed-optimizer")


def check_common_args(args: argparse.Namespace, environ: dict[str, str] | os._Environ = os.environ) -> None:
    """The mistakes that Megatron's ``validate_args`` answers with a bare ``assert`` or a deep
    traceback (or not at all), as one line naming the flag and the fix; every run, with or
    without ``--canzona``."""
    if args.train_iters is not None and args.lr_warmup_iters >= args.train_iters > 0:
        raise CanzonaArgumentError(
            f"--lr-warmup-iters {args.lr_warmup_iters} is not below --train-iters {args.train_iters}: the learning "
            "rate would never leave its warm-up; lower --lr-warmup-iters")
    if args.train_iters is not None and getattr(args, "eval_interval", 1) is None \
            and not getattr(args, "skip_train", False) and not getattr(args, "full_validation", False):
        raise CanzonaArgumentError(
            "--eval-interval is not set: megatron-core 0.19.2 divides --train-iters by it to count validation "
            "samples (a TypeError at start-up); pass --eval-interval N (with --eval-iters 0 to skip validation)")
    if args.kv_channels is None and args.hidden_size and args.num_attention_heads \
            and args.hidden_size % args.num_attention_heads:
        raise CanzonaArgumentError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}: "
            "change one, or give the head size with --kv-channels")
    world = int(environ.get("WORLD_SIZE", "1"))
    model_parallel = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                      * args.context_parallel_size)
    if world % model_parallel == 0 and args.global_batch_size is not None and args.micro_batch_size:
        dp = world // model_parallel
        if args.global_batch_size % (args.micro_batch_size * dp):
            raise CanzonaArgumentError(
                f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                f"{args.micro_batch_size} x data-parallel size {dp}: pick a global batch that is "
                f"(e.g. {args.micro_batch_size * dp * max(1, args.global_batch_size // (args.micro_batch_size * dp))})")
    if getattr(args, "use_megatron_fsdp", False) and args.pipeline_model_parallel_size > 1:
        raise CanzonaArgumentError(
            f"--use-megatron-fsdp with --pipeline-model-parallel-size {args.pipeline_model_parallel_size}: megatron-core "
            "0.19.2's Megatron-FSDP builds its device mesh over the whole world, without pipeline stages (an einops "
            "error when it wraps the model): use --use-distributed-optimizer with pipeline stages, or PP 1")
    _check_context_parallel(args)
    _check_cp_comm_type(args)
    check_megatron_optimizer_ranges(args)
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        raise CanzonaArgumentError(
            f"--ddp-bucket-size {args.ddp_bucket_size} must be a positive number of elements (or omit it for "
            "Megatron's default)")
    tokenizer = getattr(args, "tokenizer_model", None)
    # (a Hugging Face tokenizer may be a hub name; the recipes check their local directory)
    if tokenizer and args.tokenizer_type != "HuggingFaceTokenizer" and not os.path.exists(tokenizer):
        raise CanzonaArgumentError(f"--tokenizer-model {tokenizer} does not exist: fix the path")
    if tokenizer and os.path.exists(tokenizer):
        try:  # loaded now, as the tokenizer type loads it: not after the model is built, on every rank
            check_tokenizer_model(tokenizer, args.tokenizer_type)
        except ValueError as error:
            raise CanzonaArgumentError(str(error)) from None
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        try:
            check_blend_words(getattr(args, flag, None), "--" + flag.replace("_", "-"))
        except ValueError as error:
            raise CanzonaArgumentError(str(error)) from None
    calibration = getattr(args, "canzona_calibration", None)
    if calibration not in (None, "none") and not os.path.isfile(calibration):
        raise CanzonaArgumentError(f"--canzona-calibration {calibration} does not exist: fix the path, or pass 'none'")
    if calibration not in (None, "none"):
        from megatron.canzona.planning.sim.cluster import read_ns_calibration

        try:  # the fields --muon-ns-method auto reads, by the reader it uses
            read_ns_calibration(calibration)
        except ValueError as error:
            raise CanzonaArgumentError(
                f"--canzona-calibration {calibration}: {str(error).removeprefix(os.path.basename(calibration) + ': ')}; "
                "write it with tools/bench_optim.py --muon-ns-method standard gram --calibrate FILE, or pass 'none'") from None
    if getattr(args, "canzona_profile_file", None) and getattr(args, "canzona_profile_iteration", None) is None:
        raise CanzonaArgumentError(
            "--canzona-profile-file writes the profile of --canzona-profile-iteration N: add it, or drop "
            "--canzona-profile-file")
    profiled = getattr(args, "canzona_profile_iteration", None)
    if profiled is not None and not 1 <= profiled <= (args.train_iters or profiled):
        raise CanzonaArgumentError(
            f"--canzona-profile-iteration {profiled} is not an iteration of this run: pick one in 1..{args.train_iters}")
    metrics = getattr(args, "canzona_metrics_file", None)
    if metrics:
        parent = os.path.dirname(os.path.abspath(metrics))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if os.path.isfile(parent):
            raise CanzonaArgumentError(
                f"--canzona-metrics-file {metrics}: {parent} is a file, not a directory; pick another path")
        try:  # opened now: an unwritable path fails here, not after the first iteration
            os.makedirs(os.path.dirname(os.path.abspath(metrics)), exist_ok=True)
            with open(metrics, "a"):
                pass
        except OSError as error:
            raise CanzonaArgumentError(
                f"--canzona-metrics-file {metrics} cannot be written ({error.strerror or error}): pick a writable "
                "path") from None


def _check_context_parallel(args: argparse.Namespace) -> None:
    """Context parallelism: the sequence cut Megatron needs, and, without transformer-engine,
    what the CPU context-parallel attention (canzona_patches/emulation/context_parallel.py)
    does not compute."""
    cp = getattr(args, "context_parallel_size", 1)
    if cp <= 1:
        return
    if args.seq_length is not None and args.seq_length % (2 * cp):
        raise CanzonaArgumentError(
            f"--seq-length {args.seq_length} is not a multiple of 2 x --context-parallel-size {cp} = {2 * cp}: each "
            f"CP rank holds two equal chunks of every sequence; pick a multiple of {2 * cp}")
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    unsupported = [flag for flag, given in (
        ("--window-size", getattr(args, "window_size", None) is not None),
        ("--softmax-type " + str(getattr(args, "softmax_type", "vanilla")),
         getattr(args, "softmax_type", "vanilla") != "vanilla"),
        ("--reset-attention-mask", getattr(args, "reset_attention_mask", False)),
    ) if given]
    if unsupported:
        raise CanzonaArgumentError(
            f"--context-parallel-size {cp} without transformer-engine runs plain causal attention over whole "
            f"sequences; {', '.join(unsupported)} needs transformer-engine's: install it, or drop "
            f"{'it' if len(unsupported) == 1 else 'them'}")


CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
"""The values of Megatron's ``--cp-comm-type``, which its parser leaves unchecked (``all_gather``,
transformer-engine's spelling, is taken too)."""


def _check_cp_comm_type(args: argparse.Namespace) -> None:
    """``--cp-comm-type``: known types, one for every layer or one per layer."""
    types = getattr(args, "cp_comm_type", None) or ["p2p"]
    types = [types] if isinstance(types, str) else list(types)
    unknown = [t for t in types if t not in (*CP_COMM_TYPES, "all_gather")]
    if unknown:
        raise CanzonaArgumentError(
            f"--cp-comm-type {unknown[0]} is not a context-parallel communication type: pass {', '.join(CP_COMM_TYPES[:-1])} "
            f"or {CP_COMM_TYPES[-1]} (one for every layer, or one per layer)")
    if len(types) > 1 and args.num_layers is not None and len(types) != args.num_layers:
        raise CanzonaArgumentError(
            f"--cp-comm-type gives {len(types)} types for --num-layers {args.num_layers}: give one for every layer, or "
            "one per layer")


def _check_cluster(args: argparse.Namespace) -> None:
    """The cluster ``--canzona-layout auto`` projects on must load, before any rank builds."""
    if args.canzona_cluster is None:
        return
    if args.canzona_layout != "auto":
        raise CanzonaArgumentError(
            f"--canzona-cluster only serves --canzona-layout auto (the layout is {args.canzona_layout}): drop one")
    from megatron.canzona.planning.sim import load_cluster

    try:
        load_cluster(args.canzona_cluster)
    except ValueError as exc:
        raise CanzonaArgumentError(f"--canzona-cluster: {exc}") from None


def early_compute_off_by(args: argparse.Namespace) -> str | None:
    """The flag that turns early compute off in this run, if one does: it computes where the early
    gathers land, which ``--canzona-tp-mode sync`` (it gathers in the step) has none of."""
    if not args.canzona_early_gather:
        return "--canzona-no-early-gather"
    if args.canzona_tp_mode != "async":
        return f"--canzona-tp-mode {args.canzona_tp_mode}"
    return "--canzona-no-early-compute" if args.canzona_early_compute == "off" else None


def _check_early_compute(args: argparse.Namespace) -> None:
    """A flag of early compute given where another one turns it off is refused, naming both; so is
    early compute forced on with no budget to keep what it computes."""
    if args.canzona_early_compute == "on" and args.canzona_early_compute_budget == 0:
        raise CanzonaArgumentError(
            "--canzona-early-compute on with --canzona-early-compute-budget 0 keeps nothing it computes: it would "
            "compute nothing early; pass a budget (e.g. --canzona-early-compute-budget 1), or --canzona-no-early-compute")
    off = early_compute_off_by(args)
    if off is None:
        return
    if args.canzona_early_compute == "on":
        raise CanzonaArgumentError(
            f"--canzona-early-compute computes each micro-group where its early gather lands: drop {off}, or "
            "--canzona-early-compute")
    if args.canzona_matrices_reduce_first:
        raise CanzonaArgumentError(
            f"--canzona-matrices-reduce-first reorders the reduce-scatters for early compute: drop {off}, or "
            "--canzona-matrices-reduce-first")
    if args.canzona_early_compute_budget != CanzonaConfig.early_compute_bytes / 2**30:
        raise CanzonaArgumentError(
            f"--canzona-early-compute-budget {args.canzona_early_compute_budget} bounds what early compute keeps, and "
            f"{off} turns early compute off: drop one")


MEGATRON_MUON_ONLY = (("muon_tp_mode", "blockwise", "--muon-tp-mode", "--canzona-tp-mode async|sync"),
                      ("muon_split_qkv", True, "--muon-no-split-qkv", "--canzona-no-split-qkv"),
                      ("muon_scalar_optimizer", "adam", "--muon-scalar-optimizer", "--adam-* (AdamW)"))
"""Megatron's Muon flags that only its layer-wise Muon reads, as (``dest``, default, flag, what
Canzona reads instead): given with ``--canzona`` they would do nothing."""


def _check_optimizer_flags(args: argparse.Namespace) -> None:
    """Megatron's Muon flags Canzona reads have a value it knows; those it does not read, and
    Canzona's own flags of another optimizer's math, are refused."""
    for dest, default, flag, instead in MEGATRON_MUON_ONLY:
        if getattr(args, dest, default) != default:
            raise CanzonaArgumentError(
                f"{flag} sets Megatron's layer-wise Muon, which --canzona replaces: drop it (Canzona reads {instead})")
    if args.optimizer in NS_OPTIMIZERS:
        from megatron.canzona.optim.newton_schulz import EMERGING_OPTIMIZERS_COEFFICIENTS, NS_COEFFICIENTS

        known = sorted({*EMERGING_OPTIMIZERS_COEFFICIENTS, *NS_COEFFICIENTS})
        if args.muon_coefficient_type not in known:
            raise CanzonaArgumentError(
                f"--muon-coefficient-type {args.muon_coefficient_type} is not a Newton-Schulz coefficient set: pass "
                f"one of {', '.join(known)}")
    if not args.canzona_stagger_refresh and args.optimizer not in ("shampoo", "soap"):
        raise CanzonaArgumentError(
            f"--canzona-no-stagger-refresh times Shampoo's and SOAP's preconditioner refreshes; --optimizer "
            f"{args.optimizer} has none: drop it")
    calibration = args.canzona_calibration
    if calibration is None:
        return
    if args.optimizer != "muon" or args.muon_ns_method != "auto":
        raise CanzonaArgumentError(
            f"--canzona-calibration {calibration} serves --optimizer muon --muon-ns-method auto (this run: --optimizer "
            f"{args.optimizer} --muon-ns-method {args.muon_ns_method}): pass those, or drop --canzona-calibration")
    if calibration == "none":
        return
    from megatron.canzona.planning.sim.cluster import read_ns_calibration

    measured, _ = read_ns_calibration(calibration)  # check_common_args has read it whole
    ns_dtype = "float32" if args.muon_fp32_matmul_prec == "high" else "bfloat16"
    if measured != ns_dtype:
        raise CanzonaArgumentError(
            f"--canzona-calibration {calibration} timed Newton-Schulz in {measured}, this run iterates in {ns_dtype} "
            f"(--muon-fp32-matmul-prec {args.muon_fp32_matmul_prec}): calibrate in {ns_dtype}, or pass --muon-fp32-"
            f"matmul-prec {'high' if measured == 'float32' else 'medium'}")


def _check_parallelism(args: argparse.Namespace) -> None:
    """Parallel layouts the Canzona plan does not cover yet."""
    _check_early_compute(args)
    if args.canzona_matrices_reduce_first and not args.overlap_grad_reduce:
        raise CanzonaArgumentError(
            "--canzona-matrices-reduce-first reorders the reduce-scatters that overlap backward: add "
            "--overlap-grad-reduce, or drop --canzona-matrices-reduce-first")
    if not getattr(args, "use_gloo_process_groups", True):  # --disable-gloo-process-groups
        raise CanzonaArgumentError(
            "--canzona needs Megatron's gloo process groups (its distributed optimizer builds on them): "
            "drop --disable-gloo-process-groups")
    _check_expert_parallelism(args)


def _check_expert_parallelism(args: argparse.Namespace) -> None:
    if args.num_experts:
        etp = args.expert_tensor_parallel_size  # None: Megatron makes it the TP size
        check_expert_sizes(args.tensor_model_parallel_size, args.expert_model_parallel_size,
                           args.tensor_model_parallel_size if etp is None else etp,
                           fsdp=getattr(args, "use_megatron_fsdp", False))


def check_expert_sizes(tp_size: int, ep_size: int, expert_tp_size: int, *, fsdp: bool = False) -> None:
    """Canzona hosts expert matrices over the expert-data-parallel x expert-tensor-parallel ranks of
    each EP rank (Megatron's default expert TP, the TP size, included); at EP 1 experts are dense
    parameters, sharded like the others over the TP group. Megatron-FSDP's binding hosts experts
    over expert-DP alone (expert TP 1)."""
    if fsdp and ep_size > 1 and expert_tp_size != 1:
        raise CanzonaArgumentError(
            f"--canzona --use-megatron-fsdp with --expert-model-parallel-size {ep_size} needs "
            f"--expert-tensor-parallel-size 1 (it is {expert_tp_size}; Megatron defaults it to "
            "--tensor-model-parallel-size): pass --expert-tensor-parallel-size 1, or use --use-distributed-optimizer")
    if ep_size == 1 and expert_tp_size != tp_size:
        raise CanzonaArgumentError(
            f"--canzona at --expert-model-parallel-size 1 needs --expert-tensor-parallel-size equal to "
            f"--tensor-model-parallel-size {tp_size} (not {expert_tp_size}): experts are then dense parameters")


def _check_ranges(args: argparse.Namespace) -> None:
    if not 0.0 <= args.canzona_alpha <= 1.0:
        raise CanzonaArgumentError(
            f"--canzona-alpha {args.canzona_alpha} is outside [0, 1]: pass e.g. --canzona-alpha 0.5")
    if not args.grad_norm_skip_threshold > 0.0:  # NaN too
        raise CanzonaArgumentError(
            f"--grad-norm-skip-threshold {args.grad_norm_skip_threshold} must be a positive norm: pass e.g. 100, "
            "or drop it")
    if args.grad_norm_skip_threshold != float("inf") and args.clip_grad <= 0.0:
        raise CanzonaArgumentError(
            f"--grad-norm-skip-threshold {args.grad_norm_skip_threshold} reads the norm the clip computes: pass "
            "--clip-grad (e.g. 1.0), or drop --grad-norm-skip-threshold")
    if not args.canzona_early_compute_budget >= 0.0:  # NaN too
        raise CanzonaArgumentError(
            f"--canzona-early-compute-budget {args.canzona_early_compute_budget} must be 0 or more GiB: pass e.g. 1, "
            "or --canzona-no-early-compute")
    budget = args.canzona_tp_group_budget
    if budget is not None and budget <= 0:
        raise CanzonaArgumentError(
            f"--canzona-tp-group-budget {budget} must be positive: pass a cost budget or omit it")


def _check_optimizer_settings(args: argparse.Namespace) -> None:
    """The matrix optimizer's and AdamW's configs built from the flags: a field out of its range
    (the configs' own checks) is one line naming its flag (``optimizer_ranges.py``)."""
    try:
        canzona_config_from_args(args)
    except FieldError as error:
        raise CanzonaArgumentError(field_error_line(error, MATRIX_FLAGS)) from None


def finalize_canzona_args(args: argparse.Namespace) -> None:
    """After Megatron's ``validate_args``: give ``--rampup-batch-size`` its effect (every run,
    :func:`rampup_as_step_schedule`) and keep the stock distributed optimizer under Canzona.

    For any optimizer other than adam/sgd, ``validate_args`` turns
    ``--use-distributed-optimizer`` into Megatron's layer-wise distributed optimizer
    (``use_layer_wise_distributed_optimizer=True``, ``use_distributed_optimizer=False``).
    Canzona instead keeps the stock ``DistributedOptimizer`` geometry (reduce-scatter and
    all-gather over equal shards) with a layout in which every matrix lies whole in one
    shard, so the rewrite is undone here.
    """
    schedule = rampup_as_step_schedule(args)
    if schedule is not None:
        args.step_batch_size_schedule = schedule
        if args.rank == 0:
            start, increment, samples = args.rampup_batch_size
            print(f"> --rampup-batch-size {start} {increment} {samples} runs as --step-batch-size-schedule "
                  f"'{schedule}' (thresholds in tokens; Megatron-Core 0.19.2 ignores the ramp flag)", flush=True)
    restore_qk_clip_args(args)
    line = fsdp_expert_accumulation_line(args)
    if line is not None and args.rank == 0:
        print(line, flush=True)
    held = _HELD_OPTIMIZER.pop(id(args), None)
    if held is not None:
        args.optimizer = held
    if not args.canzona:
        return
    args.use_layer_wise_distributed_optimizer = False
    args.use_distributed_optimizer = True


def fsdp_expert_accumulation_line(args: argparse.Namespace) -> str | None:
    """A start-up warning (every run, Megatron's optimizers too) where Megatron-FSDP shards the
    expert buckets over one rank (expert-DP 1: EP x expert TP x PP spans the world) and reduces
    every micro-batch (``optim_grads``, ``optim_grads_params``) with several micro-batches a step.
    Its reduce then scales such a bucket, which is not sharded and accumulates the micro-batches
    in place, at each micro-batch: the earlier micro-batches' expert gradients are scaled again
    (on 2 ranks at EP 2, two micro-batches: Megatron's own AdamW's first gradient norm is 0.66667,
    DDP's 0.66699; with one micro-batch, or under ``optim``, they agree). ``None`` elsewhere."""
    if not getattr(args, "use_megatron_fsdp", False) or not getattr(args, "num_experts", None):
        return None
    strategy = args.data_parallel_sharding_strategy
    if strategy not in ("optim_grads", "optim_grads_params") or args.expert_model_parallel_size <= 1 \
            or getattr(args, "world_size", None) is None:  # (set by Megatron's validate_args)
        return None
    expert_tp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    expert_dp = args.world_size // (args.expert_model_parallel_size * expert_tp * args.pipeline_model_parallel_size)
    micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    if expert_dp != 1 or micro_batches <= 1:
        return None
    return (f"> warning: Megatron-FSDP (megatron-core 0.19.2) scales the expert buckets' gradients again at each of "
            f"the {micro_batches} micro-batches of a step where it shards them over expert-DP 1 under "
            f"--data-parallel-sharding-strategy {strategy}: pass --data-parallel-sharding-strategy optim, "
            "one micro-batch a step, or an --expert-model-parallel-size that leaves expert-DP 2 or more")


def rampup_as_step_schedule(args: argparse.Namespace) -> str | None:
    """``--rampup-batch-size START INCREMENT SAMPLES`` as a ``--step-batch-size-schedule``.

    Megatron-Core 0.19.2 still parses the ramp flag but its microbatch calculator ignores it
    (only the step schedule reaches it), so the batch would stay at ``--global-batch-size``
    from the first step. The ramp keeps its meaning from earlier Megatron releases: the batch
    grows by INCREMENT each SAMPLES / n consumed samples, n = (global batch - START) /
    INCREMENT, i.e. it is START + INCREMENT * floor(consumed * n / SAMPLES) until it reaches
    the global batch. ``--global-batch-size`` stays the final batch, which the learning-rate
    schedule and the dataset sizes of ``--train-iters`` runs count in, as they did. The
    thresholds are written in tokens (samples times ``--seq-length``), the unit in which
    Megatron reads them when the sequence length is known. ``None`` without a ramp.
    """
    if args.rampup_batch_size is None:
        return None
    start, increment, samples = args.rampup_batch_size
    final = args.global_batch_size
    if args.step_batch_size_schedule is not None:
        raise CanzonaArgumentError(
            "--rampup-batch-size and --step-batch-size-schedule both set how the batch grows: keep one")
    if args.decrease_batch_size_if_needed:
        raise CanzonaArgumentError(
            "--rampup-batch-size sets every batch size itself: drop --decrease-batch-size-if-needed")
    if min(start, increment, samples) <= 0 or start > final or (final - start) % increment:
        raise CanzonaArgumentError(
            f"--rampup-batch-size {start} {increment} {samples} must climb from START to --global-batch-size "
            f"{final} in steps of INCREMENT: pass positive numbers with {final} - START a multiple of INCREMENT")
    per_step = args.micro_batch_size * args.data_parallel_size * getattr(args, "gtp_weight_remat_size", 1)
    sizes = range(start, final + 1, increment)
    uneven = [size for size in sizes if size % per_step]
    if uneven:
        raise CanzonaArgumentError(
            f"--rampup-batch-size {start} {increment} {samples} reaches a batch of {uneven[0]}, not a multiple of "
            f"--micro-batch-size x data-parallel size = {per_step}: pick START and INCREMENT multiples of {per_step}")
    num_increments = len(sizes) - 1
    # The first consumed-sample count at which k increments have happened: ceil(k * SAMPLES / n),
    # exact in integers. A ramp of fewer samples than increments takes several at once.
    steps: dict[int, int] = {}
    for k, size in enumerate(sizes):
        steps[-(-k * samples // num_increments) if k else 0] = size
    tokens_per_sample = args.seq_length or 1
    return " ".join(f"{threshold * tokens_per_sample}:{size}" for threshold, size in steps.items())


MUON_FAMILY = ("muon", "adaptive_muon")
"""The optimizers whose Newton-Schulz input ``--canzona-exact-norm`` normalises."""


def exact_norm_of(args: argparse.Namespace) -> bool:
    """``--canzona-exact-norm`` as the run takes it: by default under Megatron-FSDP, for Muon's family."""
    if args.canzona_exact_norm is not None:
        return args.canzona_exact_norm
    return bool(getattr(args, "use_megatron_fsdp", False)) and args.optimizer in MUON_FAMILY


def narrow_gathers_of(args: argparse.Namespace) -> bool:
    """``--canzona-narrow-gathers`` as the run takes it: by default wherever it applies (Megatron-FSDP,
    Muon iterating in bf16, ``async``, the exact norm)."""
    if args.canzona_narrow_gathers is not None:
        return args.canzona_narrow_gathers
    return (bool(getattr(args, "use_megatron_fsdp", False)) and args.optimizer == "muon"
            and args.muon_fp32_matmul_prec != "high" and args.canzona_tp_mode == "async" and exact_norm_of(args))


def canzona_config_from_args(args: argparse.Namespace):
    """The ``megatron.canzona.runtime.config.CanzonaConfig`` the flags describe.

    Muon reads Megatron's ``--muon-*`` flags, Shampoo and SOAP the ``--shampoo-*`` and
    ``--soap-*`` flags above, and AdamW (embeddings, output layer, vectors) Megatron's
    ``--adam-beta1/--adam-beta2/--adam-eps``. Imported lazily: the runtime is optional
    for every run without ``--canzona``.
    """
    from megatron.canzona.optim import AdamWConfig
    from megatron.canzona.optim.newton_schulz import EMERGING_OPTIMIZERS_COEFFICIENTS
    from megatron.canzona.runtime.config import CanzonaConfig

    ns_dtype = "float32" if args.muon_fp32_matmul_prec == "high" else "bfloat16"
    # Megatron's coefficient names differ from ours ("quintic" is their tuned schedule);
    # fp32 matmul precision "high" keeps Newton-Schulz in fp32, lower ones run it in bf16.
    muon = dict(momentum=args.muon_momentum, nesterov=args.muon_nesterov,
                coefficients=EMERGING_OPTIMIZERS_COEFFICIENTS.get(args.muon_coefficient_type, args.muon_coefficient_type),
                ns_dtype=ns_dtype, num_ns_steps=args.muon_num_ns_steps, ns_measured=measured_ns_methods_of(args, ns_dtype),
                scale_mode=args.muon_scale_mode, extra_scale_factor=args.muon_extra_scale_factor)
    matrix = {
        "muon": lambda: MATRIX_FLAGS["muon"].config(args, **muon, exact_norm=exact_norm_of(args)),
        "adaptive_muon": lambda: MATRIX_FLAGS["adaptive_muon"].config(args, **muon, ns_method=args.muon_ns_method,
                                                                      exact_norm=exact_norm_of(args)),
        "shampoo": lambda: MATRIX_FLAGS["shampoo"].config(args, stagger_refresh=args.canzona_stagger_refresh),
        "soap": lambda: MATRIX_FLAGS["soap"].config(args, stagger_refresh=args.canzona_stagger_refresh),
    }[args.optimizer]()
    adamw = AdamWConfig(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    return CanzonaConfig(optimizer=args.optimizer, matrix=matrix, adamw=adamw, early_compute=args.canzona_early_compute,
                         early_compute_bytes=int(args.canzona_early_compute_budget * 2**30),
                         matrices_first=args.canzona_matrices_reduce_first,
                         narrow_gathers=narrow_gathers_of(args),
                         **{field: getattr(args, f"canzona_{field}") for field in CANZONA_FLAG_FIELDS})


SHIPPED_CALIBRATIONS = {True: os.path.join("tools", "calibrations", "h100-muon-bf16.json"), False: None}
"""``--canzona-calibration``'s default by whether CUDA is present: the H100 timings shipped with the
project on a GPU, none (the FLOP rule) on CPU."""


def measured_ns_methods_of(args: argparse.Namespace, ns_dtype: str) -> tuple[tuple[int, int, str], ...]:
    """What ``--muon-ns-method auto`` takes per measured shape: from ``--canzona-calibration``
    (``none``: the FLOP rule everywhere), by default the shipped calibration of this kind of device."""
    import torch

    from megatron.canzona.planning.sim.cluster import measured_ns_methods
    from megatron.canzona.provenance import ROOT

    if args.optimizer != "muon" or args.muon_ns_method != "auto":
        return ()
    shipped = SHIPPED_CALIBRATIONS[torch.cuda.is_available()]
    path = args.canzona_calibration or (os.path.join(ROOT, shipped) if shipped else "none")
    return () if path == "none" or not os.path.exists(path) else measured_ns_methods(path, ns_dtype)


def escaping_percent_in_help(build: Callable[..., dict], run: Any) -> Callable[..., dict]:
    """``ArgumentGroupFactory._build_argparse_kwargs_from_field`` with a literal ``%`` of the
    docstring-made help written ``%%``, as argparse's format string needs (``%(...)``
    placeholders are kept)."""

    def build_kwargs(self: Any, attribute: Any) -> dict:
        kwargs = build(self, attribute)
        if isinstance(kwargs.get("help"), str):
            kwargs["help"] = re.sub(r"%(?!\()", "%%", kwargs["help"])
        return kwargs

    return build_kwargs
