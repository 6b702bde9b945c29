"""tools/bench_step.py --iteration: the exposed optimizer time read off the iteration marks."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def bench(import_tool):
    return import_tool("bench_step")


def _rank(forward_start: list[float], backward_end: list[float]) -> dict:
    return {"iteration_marks": {"forward_start": forward_start, "backward_end": backward_end}}


def test_exposed_time_runs_from_backward_end_to_the_next_forward_on_the_slowest_rank(bench):
    fast = _rank([0.0, 1.5, 3.0, 4.5], [1.0, 2.5, 4.0, 5.5])  # 0.5 s exposed per iteration
    slow = _rank([0.0, 1.7, 3.1, 4.9], [1.0, 2.5, 4.0, 5.5])  # 0.7, 0.6, 0.9
    assert bench.exposed_times([fast, slow], warmup=0) == pytest.approx([0.7, 0.6, 0.9])
    assert bench.exposed_times([fast, slow], warmup=1) == pytest.approx([0.6, 0.9])
    assert bench.forward_backward_times([fast, slow], warmup=0) == pytest.approx([1.0, 1.0, 1.0, 1.0])
    assert bench.forward_backward_times([slow], warmup=0) == pytest.approx([1.0, 0.8, 0.9, 0.6])


def test_an_iteration_is_split_into_forward_backward_exposed_optimizer_and_the_rest(bench):
    rank = {"iteration_marks": {"forward_start": [0.0, 2.0, 4.5], "backward_end": [1.0, 3.0, 5.5],
                                "step_end": [1.5, 3.75, 6.0]}}
    parts = bench.iteration_parts([rank], warmup=0)
    assert parts["forward_backward"] == pytest.approx([1.0, 1.0, 1.0])
    assert parts["exposed_optimizer"] == pytest.approx([0.5, 0.75, 0.5])
    assert parts["rest"] == pytest.approx([0.5, 0.75])
    assert parts["iteration"] == pytest.approx([2.0, 2.5])
    assert [f + e + r for f, e, r in zip(parts["forward_backward"], parts["exposed_optimizer"], parts["rest"])] \
        == pytest.approx(parts["iteration"])


def test_marks_of_several_micro_batches_are_refused(bench):
    with pytest.raises(RuntimeError, match="one micro-batch"):
        bench.exposed_times([_rank([0.0, 0.3, 1.5], [1.0, 2.5])], warmup=0)


def test_iteration_flag_checks(bench):
    args = bench.parse_args(["--iteration", "--bucket-size", "1000000"])
    runs = bench.runs_for(args)
    assert all(r.time_iteration and r.overlap_grad_reduce for r in runs)
    assert {r.optimizer: r.overlap_param_gather for r in runs} == {
        "muon": True, "sync_muon": False, "megatron_muon": True, "adam": True}
    assert all(r.num_steps == args.warmup + args.steps + 1 for r in runs)
    with pytest.raises(SystemExit):
        bench.parse_args(["--iteration", "--moe"])


def test_iteration_at_tp2_times_the_gathers_issued_in_the_step_too(bench):
    args = bench.parse_args(["--iteration", "--tp", "2", "--dp", "1"])
    runs = bench.runs_for(args)
    assert list(bench.variants(args)) == ["canzona", "canzona_lean", "sync", "megatron", bench.LATE_GATHER,
                                          bench.DEFAULT, bench.EARLY_COMPUTE, bench.MATRICES_FIRST, bench.ADAMW]
    assert [r.early_gather for r in runs[:9]] == [True, True, True, True, False, True, True, True, True]
    # the default decides per run (auto); the early compute is forced on gloo, its gathers from the
    # reduce-scatters' dispatch, as on CUDA; the reduce order held behind the matrices in one of the two
    assert [(r.early_compute, r.early_gather_at_dispatch) for r in runs[:9]] == [(False, False)] * 5 + [
        ("auto", False)] + [(True, True)] * 2 + [(False, False)]
    assert {r.speculation for r in runs} == {"backoff"} and {r.clip_grad for r in runs} == {0.0}
    assert {r.clip_grad for r in bench.runs_for(bench.parse_args(["--iteration", "--clip-grad", "1e-3"]))} == {1e-3}
    with pytest.raises(SystemExit):
        bench.parse_args(["--iteration", "--clip-grad", "-1"])
    assert [r.matrices_first for r in runs[:9]] == [None] * 7 + [True, None]
    assert bench.LATE_GATHER not in bench.variants(bench.parse_args(["--tp", "2", "--dp", "1"]))
    assert bench.EARLY_COMPUTE not in bench.variants(bench.parse_args(["--tp", "2", "--dp", "1"]))


def test_the_early_compute_summary_reads_its_runs(bench):
    timeline = [("gather", k, 0.0, 1.0) for k in range(3)] + [("apply", k, 1.0, 2.0) for k in range(3)]
    runs = [{"tp_stats": {"timeline": timeline}, "losses": [1.0] * 4, "early_computed": 9,
             "early_steps": [{"committed": 3, "skipped": 1}]}] * 2
    parts = {"canzona": {"exposed_optimizer": 400.0}, bench.EARLY_COMPUTE: {"exposed_optimizer": 100.0}}
    default = [{"early_steps": [{}]}] * 2
    summary = bench.early_compute_summary(parts, {bench.EARLY_COMPUTE: runs, bench.DEFAULT: default})
    assert summary["fall"] == pytest.approx(0.75)
    assert summary["micro_groups"] == 3 and summary["share_of_groups_computed_before_the_step"] == pytest.approx(0.75)
    assert summary["steps_by_outcome"] == {"committed": 3, "skipped": 1} and summary["default_steps_by_outcome"] == {}


def test_fsdp_iteration_runs_whole_iterations_of_each_variant_under_megatron_fsdp(bench):
    """``--fsdp S --iteration``: AdamW, Canzona as pretrain_gpt.py runs it (early gathers, early compute
    auto), the same gathering in the step, the every-holder peer (TP 1) and, asked for, the bf16 gathers;
    one micro-batch per rank and iteration, Megatron-FSDP's collectives overlapped."""
    args = bench.parse_args(["--fsdp", "optim_grads", "--iteration", "--narrow-gathers", "--dp", "4", "--rounds", "2"])
    variants, runs = bench.fsdp_iteration_runs(args)
    assert list(variants) == [bench.ADAMW, "canzona", bench.LATE_GATHER, "every_holder", "canzona_narrow"]
    assert len(runs) == 2 * len(variants) and runs[:5] == runs[5:]
    assert all(r.fsdp == "optim_grads" and r.time_iteration and r.overlap_grad_reduce and r.overlap_param_gather
               and r.num_steps == args.warmup + args.steps + 1 and r.global_batch == 2 * 4 and r.micro_batch == 2
               for r in runs)
    assert [(r.optimizer, r.early_gather, r.early_compute, r.narrow_gathers) for r in runs[:5]] == [
        ("adam", True, False, False), ("muon", True, "auto", False), ("muon", False, False, False),
        ("every_holder", False, False, False), ("muon", True, "auto", True)]
    tp2 = bench.parse_args(["--fsdp", "optim_grads_params", "--iteration", "--tp", "2", "--dp", "2"])
    variants, runs = bench.fsdp_iteration_runs(tp2)
    assert list(variants) == [bench.ADAMW, "canzona", bench.LATE_GATHER]  # the peer runs at TP 1 only
    assert {r.global_batch for r in runs} == {4} and {r.tp_size for r in runs} == {2}
    with pytest.raises(SystemExit):
        bench.parse_args(["--fsdp", "optim", "--iteration", "--gantt", "x.png"])
