"""``--canzona --use-megatron-fsdp`` at parse time: what is not built under it yet is refused in
one line naming the flag (every entry of :data:`FSDP_REFUSED`), what it takes passes, and
``--optimizer`` is held from Megatron's ``validate_args`` (which allows only sgd and adam under
Megatron-FSDP) and given back after it."""

from __future__ import annotations

import pytest

from canzona_patches.integration.arguments import (
    FSDP_REFUSED,
    CanzonaArgumentError,
    canzona_config_from_args,
    finalize_canzona_args,
    validate_canzona_args,
)

from test_flags_need_their_run import parse

pytestmark = pytest.mark.quick

FSDP = ["--canzona", "--optimizer", "muon", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
SET = {"canzona_matrices_reduce_first": ["--canzona-matrices-reduce-first", "--overlap-grad-reduce"]}
"""Command-line words that set each refused flag."""


def test_every_refused_flag_has_words_that_set_it() -> None:
    assert set(SET) == {dest for dest, *_ in FSDP_REFUSED}


@pytest.mark.parametrize("dest", [dest for dest, *_ in FSDP_REFUSED])
def test_what_is_not_built_under_fsdp_is_refused_naming_its_flag(dest: str) -> None:
    flag = next(flag for d, _, flag, _ in FSDP_REFUSED if d == dest).split()[0]
    with pytest.raises(CanzonaArgumentError) as refused:
        validate_canzona_args(parse(*FSDP, *SET[dest]))
    line = str(refused.value)
    assert "\n" not in line and len(line) < 300, line
    assert line.startswith("--canzona --use-megatron-fsdp does not run with ") and f"drop {flag}," in line, line


@pytest.mark.parametrize("canzona", [True, False])
def test_pipeline_stages_under_megatron_fsdp_are_refused_in_one_line(canzona: bool) -> None:
    """Megatron-FSDP (megatron-core 0.19.2) has no pipeline stages, for Megatron's own optimizers too:
    one line instead of an einops error at wrapping."""
    words = FSDP if canzona else ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
    with pytest.raises(CanzonaArgumentError) as refused:
        validate_canzona_args(parse(*words, "--pipeline-model-parallel-size", "2"))
    line = str(refused.value)
    assert "\n" not in line and line.startswith("--use-megatron-fsdp with --pipeline-model-parallel-size 2:"), line


def test_context_parallelism_passes() -> None:
    """CP under Megatron-FSDP: the plan over DP x CP, as Megatron-FSDP shards over dp_cp."""
    args = parse(*FSDP, "--context-parallel-size", "2")
    validate_canzona_args(args)
    finalize_canzona_args(args)
    assert args.context_parallel_size == 2


@pytest.mark.parametrize("ep", [1, 2])
def test_experts_pass_at_any_ep_size(ep: int) -> None:
    """Experts under Megatron-FSDP: a dense and an expert Canzona optimizer, the expert buckets over
    the expert-data-parallel group (tests/e2e/test_canzona_fsdp.py runs them)."""
    args = parse(*FSDP, "--num-experts", "4", "--expert-model-parallel-size", str(ep),
                 "--expert-tensor-parallel-size", "1")
    validate_canzona_args(args)
    finalize_canzona_args(args)
    assert args.optimizer == "muon"


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("optimizer", ["muon", "adaptive_muon", "shampoo", "soap"])
def test_each_strategy_and_optimizer_passes_with_the_optimizer_held_from_megatron(strategy: str, optimizer: str) -> None:
    args = parse(*FSDP, "--optimizer", optimizer, "--data-parallel-sharding-strategy", strategy,
                 "--tensor-model-parallel-size", "2", "--sequence-parallel", "--canzona-tp-mode", "sync")
    validate_canzona_args(args)
    assert args.optimizer == "adam"  # what Megatron-FSDP's own check in validate_args allows
    finalize_canzona_args(args)
    assert args.optimizer == optimizer and args.use_distributed_optimizer
    assert not args.use_layer_wise_distributed_optimizer


@pytest.mark.parametrize(("words", "says"), [
    (["--data-parallel-sharding-strategy", "no_shard"], "pass optim, optim_grads or optim_grads_params"),
    (["--canzona-layout", "lean"], "drop --canzona-layout"),
    (["--canzona-matrices-reduce-first", "--overlap-grad-reduce"], "drop --canzona-matrices-reduce-first"),
    (["--num-distributed-optimizer-instances", "2"], "drop --num-distributed-optimizer-instances"),
])
def test_what_the_fsdp_binding_does_not_take(words: list[str], says: str) -> None:
    with pytest.raises(CanzonaArgumentError) as refused:
        validate_canzona_args(parse(*FSDP, *words))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_torch_fsdp2_is_pointed_to_megatron_fsdp() -> None:
    with pytest.raises(CanzonaArgumentError) as refused:
        validate_canzona_args(parse("--canzona", "--optimizer", "muon", "--use-torch-fsdp2"))
    assert "use --use-megatron-fsdp, or --use-distributed-optimizer" in str(refused.value)


def test_fsdp_dtensor_checkpoints_are_accepted() -> None:
    """--save and --load with --ckpt-format fsdp_dtensor pass the flag checks (docs/fsdp.md#checkpoints)."""
    validate_canzona_args(parse(*FSDP, "--save", "/nonexistent/ckpt", "--load", "/nonexistent/ckpt"))


@pytest.mark.parametrize(("world", "ep", "strategy", "global_batch", "warned"), [
    (2, 2, "optim_grads_params", 8, True),  # expert-DP 1, two micro-batches a step
    (2, 2, "optim_grads", 8, True),
    (2, 2, "optim", 8, False),  # reduced once a step
    (2, 2, "optim_grads_params", 4, False),  # one micro-batch
    (4, 2, "optim_grads_params", 8, False),  # expert-DP 2
])
def test_megatron_fsdps_expert_accumulation_at_expert_dp_1_is_named_at_start_up(
        world: int, ep: int, strategy: str, global_batch: int, warned: bool) -> None:
    """Every run under Megatron-FSDP (Megatron's own optimizers too) whose expert buckets are sharded
    over one rank and reduced at every micro-batch of several: one warning line (docs/fsdp.md#experts)."""
    from argparse import Namespace

    from canzona_patches.integration.arguments import fsdp_expert_accumulation_line

    args = Namespace(use_megatron_fsdp=True, num_experts=4, data_parallel_sharding_strategy=strategy,
                     expert_model_parallel_size=ep, expert_tensor_parallel_size=1, tensor_model_parallel_size=1,
                     pipeline_model_parallel_size=1, world_size=world, global_batch_size=global_batch,
                     micro_batch_size=2, data_parallel_size=world)
    line = fsdp_expert_accumulation_line(args)
    assert (line is not None) == warned, line
    if warned:
        assert "\n" not in line and f"--data-parallel-sharding-strategy {strategy}" in line and "expert-DP 1" in line


@pytest.mark.parametrize("groups", ["one", "budget"])
def test_micro_groups_are_chosen_under_fsdp_and_refused_elsewhere(groups: str) -> None:
    """``--canzona-fsdp-micro-groups`` groups the matrices under Megatron-FSDP: taken there, refused
    in one line under the distributed optimizer (whose groups follow --canzona-tp-group-budget), and
    ``one`` refused beside a budget per group."""
    args = parse(*FSDP, "--canzona-fsdp-micro-groups", groups)
    validate_canzona_args(args)
    finalize_canzona_args(args)
    with pytest.raises(CanzonaArgumentError, match=f"^--canzona-fsdp-micro-groups {groups} groups the matrices "
                       "under --use-megatron-fsdp.*drop --canzona-fsdp-micro-groups$"):
        validate_canzona_args(parse("--canzona", "--optimizer", "muon", "--use-distributed-optimizer",
                                    "--canzona-fsdp-micro-groups", groups))
    budget = parse(*FSDP, "--canzona-fsdp-micro-groups", groups, "--canzona-tp-group-budget", "5")
    if groups == "budget":
        validate_canzona_args(budget)
        return
    with pytest.raises(CanzonaArgumentError, match="^--canzona-fsdp-micro-groups one puts every matrix in one "
                       "micro-group, and --canzona-tp-group-budget caps a host's cost per group: drop one$"):
        validate_canzona_args(budget)


@pytest.mark.parametrize("together", ["auto", "all"])
def test_tp_together_is_taken_with_fsdp_muon_and_tp_and_refused_without_each(together: str) -> None:
    """``--canzona-tp-together`` computes TP-sharded Muon matrices on their TP ranks together under
    Megatron-FSDP: taken there, refused in one line naming what it needs where any of it is missing."""
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    args = parse(*FSDP, *tp2, "--canzona-tp-together", together)
    validate_canzona_args(args)
    finalize_canzona_args(args)
    assert canzona_config_from_args(args).tp_together == together
    missing = {
        "--use-megatron-fsdp": ["--canzona", "--optimizer", "muon", "--use-distributed-optimizer", *tp2],
        "--optimizer muon": [*FSDP[:2], "shampoo", *FSDP[3:], *tp2],
        "--tensor-model-parallel-size above 1": FSDP,
        "--canzona-tp-mode async": [*FSDP, *tp2, "--canzona-tp-mode", "sync"],
    }
    for needed, words in missing.items():
        with pytest.raises(CanzonaArgumentError, match=f"^--canzona-tp-together {together} computes TP-sharded Muon "
                           f"matrices .* it needs {needed}: add that, or drop --canzona-tp-together$"):
            validate_canzona_args(parse(*words, "--canzona-tp-together", together))


def _config(*words: str):
    args = parse(*words)
    validate_canzona_args(args)
    finalize_canzona_args(args)
    return canzona_config_from_args(args)


def test_narrow_gathers_and_the_exact_norm_are_the_default_under_fsdp_and_refused_without_what_they_need() -> None:
    """Under Megatron-FSDP Muon's family normalises by the exact norm (``--canzona-exact-norm``), and
    Muon iterating in bf16 (``async``) sends its normalised source in bf16 (``--canzona-narrow-gathers``);
    under the distributed optimizer neither, unless asked (the exact norm only); each can be turned off;
    refused in one line naming what it needs where any of it is missing."""
    default = _config(*FSDP)
    assert (default.narrow_gathers, default.matrix.exact_norm) == (True, True)
    assert (_config(*FSDP, "--canzona-no-narrow-gathers").narrow_gathers, _config(*FSDP, "--canzona-no-narrow-gathers").matrix.exact_norm) == (False, True)
    off = _config(*FSDP, "--canzona-no-exact-norm")
    assert (off.narrow_gathers, off.matrix.exact_norm) == (False, False)
    for words in (["--muon-fp32-matmul-prec", "high"], ["--canzona-tp-mode", "sync"]):
        config = _config(*FSDP, *words)  # not narrow, still the exact norm: bitwise the narrow run's math
        assert (config.narrow_gathers, config.matrix.exact_norm) == (False, True), words
    assert _config(*FSDP[:2], "adaptive_muon", *FSDP[3:]).matrix.exact_norm is True
    distopt = ["--canzona", "--optimizer", "muon", "--use-distributed-optimizer"]
    assert (_config(*distopt).narrow_gathers, _config(*distopt).matrix.exact_norm) == (False, False)
    assert _config(*distopt, "--canzona-exact-norm").matrix.exact_norm is True
    assert _config(*FSDP, "--canzona-narrow-gathers").narrow_gathers is True
    missing = {
        "--use-megatron-fsdp": distopt,
        "--optimizer muon": [*FSDP[:2], "shampoo", *FSDP[3:]],
        r"--muon-fp32-matmul-prec medium \(Newton-Schulz in bf16\)": [*FSDP, "--muon-fp32-matmul-prec", "high"],
        "--canzona-tp-mode async": [*FSDP, "--canzona-tp-mode", "sync"],
        "--canzona-exact-norm": [*FSDP, "--canzona-no-exact-norm"],
    }
    for needed, words in missing.items():
        with pytest.raises(CanzonaArgumentError, match=f"^--canzona-narrow-gathers sends Muon's normalised .* it needs "
                           f"{needed}: add that, or drop --canzona-narrow-gathers$"):
            validate_canzona_args(parse(*words, "--canzona-narrow-gathers"))
    with pytest.raises(CanzonaArgumentError, match="^--canzona-exact-norm normalises Newton-Schulz's input of Muon, "
                       "AdaMuon and NorMuon; --optimizer soap has none: drop --canzona-exact-norm$"):
        validate_canzona_args(parse(*FSDP[:2], "soap", *FSDP[3:], "--canzona-exact-norm"))
