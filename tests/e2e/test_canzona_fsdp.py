"""``--canzona`` under Megatron-FSDP (``--use-megatron-fsdp``): the plan bound to the buckets and
shards Megatron-FSDP builds (``canzona_patches.integration.binding.bind_fsdp``), every matrix
gathered to one host by the same ``HostGroupEngine`` the distributed optimizer's binding uses, the
update written into Megatron-FSDP's main-weight shards, its own all-gathers and reduce-scatters
kept.

Each run is compared with ``--canzona --use-distributed-optimizer`` at the same DP and TP, the
layout whose own exactness against one process the other tests hold:

* ``optim`` reduces each step's gradients once, as DDP does: every loss is **bitwise** the
  distributed optimizer's (the gradient norm, summed over other shards, within 1e-6) while the
  clip does not act; with ``--clip-grad`` acting every step and a step skipped by
  ``--grad-norm-skip-threshold``, within the tolerances below (measured 3.9e-7). The QK-clip cases
  run on MKL's reproducible code path (:data:`QK_CLIP_ENV`);
* ``optim_grads`` and ``optim_grads_params`` reduce-scatter every micro-batch, so the gradients are
  summed in another order: the losses agree within the tolerances the distributed-optimizer tests
  use (``test_context_parallel``: 1e-5 of the largest loss, the first loss within 1e-6), gradient
  norms within 1e-4. Measured on 2 cores for Muon: at most 1.5e-6 relative in
  the losses and 7.1e-5 in the gradient norms (TP 2 x DP 2), as for the distributed optimizer's own DP 1 against
  DP 2 (2.6e-6, 3.5e-5).

Under ``--bf16`` (Muon, DP 2, ``optim``) Megatron-FSDP's own bf16 gradients depart from the first
step: the losses within :data:`BF16_LOSS_RTOL`.

``async`` (its gathers issued in backward, as each bucket's last reduce-scatter ends) and ``sync``
(``--canzona-tp-mode``) are bitwise equal, and so is ``--canzona-early-compute on``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from canzona_patches.checkpoints.convert import load_keys, read_contents

from .support import ROOT, DemoData, launch_ranks
from .test_megatron_fsdp import FSDP, ITERS, RUN_TIMEOUT_S, moe
from .test_megatron_fsdp import _args as train_args
from .test_megatron_fsdp import _train as train

pytestmark = pytest.mark.slow

LOSS_RTOL = {"muon": 1e-5}
FIRST_LOSS_RTOL = 1e-6
GRAD_NORM_RTOL = 1e-4
QK_TAU = 0.1
TP2 = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
SMALL_BUCKETS = ("--ddp-bucket-size", "20000")
NARROW = "--canzona-narrow-gathers"
"""Muon's input gathered in bf16 (Megatron-FSDP only: its reference runs without it). The default
under Megatron-FSDP for Muon iterating in bf16, as every Muon case here but ``--muon-fp32-matmul-prec
high``'s; named in the ``--bf16`` case, which checks its start-up line."""
FP32_NS = ("--muon-fp32-matmul-prec", "high")
"""Newton-Schulz in fp32, as the exactness tests run it, where a case's gradients are reduced in
another order than its reference's under TP: in bf16 the rounding of the reduction's last bits
flips bf16 roundings of Newton-Schulz's input from step to step, which four steps amplify to the
tolerances' size (TP 2 x DP 2 ``optim_grads_params``: gradient norms 0.8-1.3e-4 apart at the fourth
step from one run to another, against 1e-4; DP 2 ``optim_grads_params``, 6.8e-5 on one machine, whose
BLAS rounds otherwise than another's; so too under ``optim`` once QK-clip's steps were clipped by
factors whose last bits differ). DP 4 x EP 2 and CP 2 x DP 2 iterate in bf16, as the default does."""
EXACT = "--canzona-exact-norm"
"""Muon's family divides Newton-Schulz's input by the norm summed in integers: the default under
Megatron-FSDP, so the distributed-optimizer references of those optimizers take it too."""
QK_CLIP = ("--qk-clip", "--qk-clip-threshold", str(QK_TAU), "--log-max-attention-logit")
"""QK-clip on the rows of ``linear_qkv`` each rank's shard holds, acting at every step (every
layer's largest logit is over the threshold)."""
CLIPPED = ("--clip-grad", "0.3", "--grad-norm-skip-threshold", "0.8")
"""The clip acts at every step (the norms are 0.6-0.8), and a step over 0.8 is skipped."""
QK_CLIP_ENV = {"MKL_CBWR": "COMPATIBLE"}
"""The QK-clip cases' ranks, both layouts, on MKL's reproducible code path: QK-clip at this threshold
scales every head's query and key rows by about 0.17 a step, and makes the gradient norms grow past
the clip (1.0) from iteration 2; on an AVX-512 machine's default MKL path the two layouts' fourth
losses then part by 7.7e-8 and the largest logits by 3.2e-5 (bitwise on another machine), while
under ``MKL_CBWR=COMPATIBLE`` every loss is bitwise and the fourth largest logit within 7.3e-8."""
BF16_LOSS_RTOL = 5e-5
"""``--bf16``: losses within this of the largest loss. Megatron-FSDP's bf16 gradients depart from the
distributed optimizer's from the first step (its first gradient norm by 5.8e-6 relative), as its
own AdamW's do: its third loss by 9.3e-6 relative; Canzona's Muon's by 1.4e-5 (measured on an AVX-512
machine)."""
BF16_GRAD_NORM_RTOL = 1e-3
"""``--bf16``: gradient norms within this, relative. Measured: Canzona's Muon's fourth by 2.3e-4;
Megatron's own AdamW under FSDP departs from its distributed optimizer's by 1.0e-4 there."""
QK_LOGIT_RTOL = 1e-5
"""The largest logits after a clipped step: ``tests/e2e/test_qk_clip.py``'s bound against one process."""

CASES = {
    # name: (ranks, optimizer, sharding strategy, extra flags)
    "muon-dp2-optim_grads_params": (2, "muon", "optim_grads_params", FP32_NS),
    "muon-dp2-optim-clipped": (2, "muon", "optim", CLIPPED),
    "muon-dp4_ep2-optim_grads_params": (4, "muon", "optim_grads_params", moe(2)),
    "muon-dp2-optim-qk_clip": (2, "muon", "optim", QK_CLIP),
    "muon-dp2-optim-split_gate_up": (2, "muon", "optim", ("--canzona-split-gate-up",)),
    "muon-dp2-optim-bf16": (2, "muon", "optim", ("--bf16", NARROW)),
    "muon-tp2_dp2-optim_grads_params": (4, "muon", "optim_grads_params", (*TP2, *FP32_NS)),
    "muon-cp2_dp2-optim_grads_params": (4, "muon", "optim_grads_params", ("--context-parallel-size", "2")),
    "muon-tp2_dp2-optim-qk_clip": (4, "muon", "optim", (*TP2, *QK_CLIP, *FP32_NS)),
    "adaptive_muon-dp2-optim": (2, "adaptive_muon", "optim", ()),
    "shampoo-dp2-optim-buckets": (2, "shampoo", "optim", SMALL_BUCKETS),
    "soap-dp2-optim": (2, "soap", "optim", ()),
}
"""The FSDP runs: DP 2 (in bf16 with Muon's input gathered narrow: ``--canzona-narrow-gathers``,
whose reference gathers in fp32), DP 4 with experts over EP 2 (a dense and an expert Canzona optimizer, the
experts' buckets over expert-DP 2), TP 2 x DP 2, CP 2 x DP 2 (the plan over DP x CP, as Megatron-FSDP
shards over it), every optimizer, several buckets without units
(``optim`` with 20,000-element buckets), gate and up hosted apart (what docs/fsdp.md's projection
recommends at scale); ``optim_grads`` is held to the one-device math by
tests/multirank/test_replay_fsdp.py and to the plan's bytes by test_bench_fsdp.py. AdaMuon's normalisation by its second
moment, Shampoo's inverse roots and SOAP's eigenbases amplify the reduction order's last bits
(under ``optim_grads_params`` AdaMuon's third loss moves by 1.7e-5, Shampoo's third gradient norm
by 1.6e-4; SOAP's third loss by 4e-3, as much as the distributed optimizer's own DP 1 against DP 2
on this tiny model): they run where the order is DDP's, and are bitwise."""
CONVERTED = "muon-dp2-optim-split_gate_up"
"""The case whose checkpoints move between the layouts (``tools/convert_checkpoint.py``): its
distributed-optimizer reference saves ``torch_dist`` checkpoints too, and each layout resumes from
the other's iteration 2 converted. Under ``optim`` the two layouts train bitwise alike, so both
resumes are held bitwise to the uninterrupted runs (gate and up hosted apart: Muon's momentum
pieces are Q, K, V and gate, up, merged into and split from Megatron-FSDP's holders' layout)."""
SAVED = ("muon-dp2-optim_grads_params", "muon-dp4_ep2-optim_grads_params", "muon-tp2_dp2-optim_grads_params",
         "muon-cp2_dp2-optim_grads_params", "shampoo-dp2-optim-buckets", CONVERTED)
"""The cases that also save ``fsdp_dtensor`` checkpoints at iterations 2 and 4."""
RESUMES = {
    # name: (the saved case, ranks of the resumed run, its layout flags)
    "muon-dp2-to-dp2": ("muon-dp2-optim_grads_params", 2, FP32_NS),
    "muon-dp2-to-dp4": ("muon-dp2-optim_grads_params", 4, FP32_NS),
    "muon-dp4_ep2-to-dp4_ep2": ("muon-dp4_ep2-optim_grads_params", 4, moe(2)),
    "muon-dp4_ep2-to-dp2_ep1": ("muon-dp4_ep2-optim_grads_params", 2, moe(1)),
    "muon-tp2_dp2-to-dp2": ("muon-tp2_dp2-optim_grads_params", 2, FP32_NS),
    "muon-cp2_dp2-to-dp2": ("muon-cp2_dp2-optim_grads_params", 2, ()),
    "shampoo-dp2-to-dp2": ("shampoo-dp2-optim-buckets", 2, SMALL_BUCKETS),
}
"""Resumes from iteration 2 of a saved case: at the same layout bitwise; at another FSDP, TP or EP
size (the plan, the hosts and the shards all change; at EP 1 the experts are dense parameters of
one optimizer; the state tensors are name-keyed global tensors, experts by global index, read
block by block) within the tolerances of the ``optim_grads_params`` comparisons (the
gradients are reduce-scattered over other shards: measured at most 4.7e-7 in the losses, 6.6e-5
in the grad norms, both TP 2 x DP 2 -> DP 2, on an AVX-512 machine; 7.8e-8 and 9.0e-6 on another)."""
BITWISE = "optim"
"""The strategy whose gradients are reduced as DDP reduces them: bitwise, unless the clip acts
(its factor is computed from the norm, whose summation over other shards differs in the last
bits: the clipped case is held to the tolerance)."""


def _canzona(optimizer: str, *extra: str) -> tuple[str, ...]:
    return ("--canzona", "--optimizer", optimizer, *extra)


def _reference(nproc: int, optimizer: str, extra: tuple[str, ...]) -> tuple:
    """The key of a case's distributed-optimizer reference: its ranks, optimizer and flags, but
    Megatron-FSDP's own (``--canzona-narrow-gathers``), with Megatron-FSDP's default exact norm
    (Muon's family)."""
    exact = (EXACT,) if optimizer in ("muon", "adaptive_muon") else ()
    return (nproc, optimizer, (*exact, *(flag for flag in extra if flag != NARROW)))


@pytest.fixture(scope="module")
def runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every FSDP case, its distributed-optimizer reference (one per ranks, optimizer and flags),
    and the first case again with ``--canzona-tp-mode sync`` and with ``--canzona-early-compute on``."""
    root = tmp_path_factory.mktemp("canzona_fsdp")
    out: dict = {}
    for name, (nproc, optimizer, strategy, extra) in CASES.items():
        reference = _reference(nproc, optimizer, extra)
        env = QK_CLIP_ENV if "--qk-clip" in extra else None
        if reference not in out:
            saved = ("--save", str(root / f"{name}-distopt" / "ckpt"), "--save-interval", "2") if name == CONVERTED else ()
            out[reference] = train(demo_data, root / f"{name}-distopt", nproc,
                                   *_canzona(optimizer, "--use-distributed-optimizer", *reference[2]), *saved, env=env)
        save = ("--save", str(root / name / "ckpt"), "--save-interval", "2") if name in SAVED else ()
        out[name] = train(demo_data, root / name, nproc, *_canzona(optimizer, *FSDP, *extra),
                          "--data-parallel-sharding-strategy", strategy, *save, env=env)
    first = next(iter(CASES))
    nproc, optimizer, strategy, extra = CASES[first]
    out["sync"] = train(demo_data, root / "sync", nproc, *_canzona(optimizer, *FSDP, *extra),
                        "--data-parallel-sharding-strategy", strategy, "--canzona-tp-mode", "sync")
    out["early_compute"] = train(demo_data, root / "early_compute", nproc, *_canzona(optimizer, *FSDP, *extra),
                                 "--data-parallel-sharding-strategy", strategy, "--canzona-early-compute", "on")
    for name, (saved, nproc, extra) in RESUMES.items():
        _, optimizer, strategy, _ = CASES[saved]
        out[name] = train(demo_data, root / name, nproc, *_canzona(optimizer, *FSDP, *extra),
                          "--data-parallel-sharding-strategy", strategy, "--load", str(root / saved / "ckpt"),
                          "--ckpt-step", "2")
    out.update(_converted_resumes(demo_data, root))
    first = next(iter(RESUMES.values()))[0]
    out["wrong_optimizer"] = launch_ranks(2, "pretrain_gpt.py", *train_args(
        demo_data, root / "wrong_optimizer", *_canzona("shampoo", *FSDP), "--data-parallel-sharding-strategy",
        CASES[first][2], "--load", str(root / first / "ckpt"), "--ckpt-step", "2"), timeout_s=RUN_TIMEOUT_S)
    return out


def _converted_resumes(demo_data: DemoData, root) -> dict:
    """:data:`CONVERTED`'s iteration 2 converted each way and resumed in the other layout; and the
    distributed optimizer's checkpoint given as it is to a Megatron-FSDP run."""
    nproc, optimizer, strategy, extra = CASES[CONVERTED]
    layouts = {"fsdp_dtensor": (*FSDP, "--data-parallel-sharding-strategy", strategy),
               "torch_dist": ("--use-distributed-optimizer", EXACT)}
    sources = {"fsdp_dtensor": root / f"{CONVERTED}-distopt" / "ckpt", "torch_dist": root / CONVERTED / "ckpt"}
    out: dict = {}
    for to, source in sources.items():
        converted = root / f"converted-{to}"
        out[f"convert-{to}"] = launch_ranks(1, "tools/convert_checkpoint.py", "--load", str(source), "--ckpt-step", "2",
                                            "--save", str(converted), "--to", to, timeout_s=RUN_TIMEOUT_S)
        assert out[f"convert-{to}"].returncode == 0, out[f"convert-{to}"].stdout[-3000:]
        out[f"resume-{to}"] = train(demo_data, root / f"resume-{to}", nproc, *_canzona(optimizer, *layouts[to], *extra),
                                    "--load", str(converted))
        own = sources["torch_dist" if to == "fsdp_dtensor" else "fsdp_dtensor"] / "iter_0000002"
        out[f"tensors-{to}"] = [_tensors(converted / "iter_0000002"), _tensors(own)]
    out["wrong_format"] = launch_ranks(nproc, "pretrain_gpt.py", *train_args(
        demo_data, root / "wrong_format", *_canzona(optimizer, *layouts["fsdp_dtensor"], *extra),
        "--load", str(sources["fsdp_dtensor"]), "--ckpt-step", "2"), timeout_s=RUN_TIMEOUT_S)
    return out


def _tensors(path) -> dict:
    """Every tensor of a checkpoint (torch DCP, either format), read whole by this process."""
    contents = read_contents(path)
    return load_keys(path, contents.tensors)


@pytest.mark.parametrize("to", ["fsdp_dtensor", "torch_dist"])
def test_a_checkpoint_moves_between_the_distributed_optimizer_and_megatron_fsdp(runs: dict, to: str) -> None:
    """Iteration 2 of one layout, converted by tools/convert_checkpoint.py, resumed in the other:
    iterations 3 and 4 are bitwise the other layout's uninterrupted run (under ``optim`` the two
    layouts train alike: :data:`CONVERTED`)."""
    nproc, optimizer, _, extra = CASES[CONVERTED]
    straight = runs[CONVERTED if to == "fsdp_dtensor" else _reference(nproc, optimizer, extra)]["metrics"]
    resumed = runs[f"resume-{to}"]["metrics"]
    assert sorted(resumed) == [3, 4]
    for iteration, got in resumed.items():
        want = straight[iteration]
        assert (got["lm_loss"], got["grad_norm"]) == (want["lm_loss"], want["grad_norm"]), (to, iteration)
    assert f"-> {to}: " in runs[f"convert-{to}"].stdout and "[convert] done in" in runs[f"convert-{to}"].stdout
    converted, own = runs[f"tensors-{to}"]  # the converted checkpoint is the target layout's own, tensor for tensor
    assert sorted(converted) == sorted(own) and len(own) > 50
    assert [key for key in own if not torch.equal(converted[key], own[key])] == []
    assert "Traceback" not in runs[f"resume-{to}"]["stdout"]


def test_a_checkpoint_of_the_other_layout_is_named_in_one_line_with_its_conversion(runs: dict) -> None:
    """A ``torch_dist`` checkpoint given to a Megatron-FSDP run: one line on every rank naming the
    format, the layout it came from and the command that converts it, before anything is read."""
    result = runs["wrong_format"]
    assert result.returncode != 0
    line = ("is a torch_dist checkpoint (saved under --use-distributed-optimizer), this run reads fsdp_dtensor "
            "(--use-megatron-fsdp): convert it once with python tools/convert_checkpoint.py --load ")
    assert result.stdout.count(line) >= 1 and "--ckpt-step 2 --save NEW_DIR --to fsdp_dtensor" in result.stdout, \
        result.stdout[-3000:]
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize("name", list(CASES))
def test_canzona_under_megatron_fsdp_trains_as_under_the_distributed_optimizer(runs: dict, name: str) -> None:
    nproc, optimizer, _, extra = CASES[name]
    fsdp, reference = runs[name]["metrics"], runs[_reference(nproc, optimizer, extra)]["metrics"]
    assert sorted(fsdp) == sorted(reference) == list(range(1, ITERS + 1))
    largest = max(abs(m["lm_loss"]) for m in reference.values())
    bf16 = "--bf16" in extra
    bitwise = CASES[name][2] == BITWISE and extra != CLIPPED and not bf16
    loss_rtol = BF16_LOSS_RTOL if bf16 else LOSS_RTOL.get(optimizer)  # (bitwise cases need none)
    norm_rtol = 1e-6 if bitwise else BF16_GRAD_NORM_RTOL if bf16 else GRAD_NORM_RTOL
    worst_loss = worst_norm = 0.0
    for iteration, want in reference.items():
        got = fsdp[iteration]
        loss_diff = abs(got["lm_loss"] - want["lm_loss"])
        # bitwise until a step clipped its gradients (train_args' --clip-grad 1.0) by another factor: the
        # factor comes from the norm, summed over other shards (BITWISE), whose last bits may differ
        apart = any(reference[i]["grad_norm"] > 1.0 and fsdp[i]["grad_norm"] != reference[i]["grad_norm"]
                    for i in range(1, iteration))
        exact = bitwise and not apart
        bound = 0.0 if exact else FIRST_LOSS_RTOL * abs(want["lm_loss"]) if iteration == 1 else \
            (loss_rtol or LOSS_RTOL["muon"]) * largest
        assert loss_diff <= bound, (name, iteration, got["lm_loss"], want["lm_loss"])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=norm_rtol if exact or not bitwise
                                                 else GRAD_NORM_RTOL), (name, iteration)
        worst_loss = max(worst_loss, loss_diff / abs(want["lm_loss"]))
        worst_norm = max(worst_norm, abs(got["grad_norm"] / want["grad_norm"] - 1))
    print(f"[canzona-fsdp] {name}: largest relative difference, losses {worst_loss:.1e}, grad norms {worst_norm:.1e}")
    if "--qk-clip" in extra:  # the same largest logits; over the threshold, so the clip acts
        for iteration, want in reference.items():
            # bitwise until a step's gradients were clipped; then as test_qk_clip's
            clipped = any(reference[i]["grad_norm"] > 1.0 for i in range(1, iteration))
            assert fsdp[iteration]["max_attention_logit"] > QK_TAU
            assert fsdp[iteration]["max_attention_logit"] == pytest.approx(
                want["max_attention_logit"], rel=0 if bitwise and not clipped else QK_LOGIT_RTOL), iteration
        assert f"[canzona] QK-clip: threshold {QK_TAU:g}" in runs[name]["stdout"]
    if extra == CLIPPED:  # the fourth step's norm is over the threshold: skipped under both
        for run in (runs[name], runs[_reference(nproc, optimizer, extra)]):
            assert re.search(r"iteration +4/ +4 \|.*number of skipped iterations: +1 \|", run["stdout"]), name
    if NARROW in extra:  # fc1, fc2 and the projection of both layers go to their hosts in bf16
        assert "[canzona] narrow gathers: " in runs[name]["stdout"]
    assert fsdp[ITERS]["lm_loss"] < fsdp[1]["lm_loss"]  # it trains


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_is_over_megatron_fsdps_buckets(runs: dict, name: str) -> None:
    """The start-up lines: the plan is the fsdp layout over DP x TP (every matrix of the tiny
    model: 2 layers of 4, per TP rank; 5 with gate and up apart), early compute is off on gloo and says why; the binding found
    every planned piece where Megatron-FSDP put it (it refuses to build otherwise)."""
    nproc, _, _, extra = CASES[name]
    tp = 2 if "--tensor-model-parallel-size" in extra else 1
    out = runs[name]["stdout"]
    plan = re.search(r"\[canzona\] plan: fsdp layout, (\d+) matrices over DP (\d+)(?: x CP (\d+))? x TP (\d+), "
                     r"(\d+) bucket\(s\)", out)
    assert plan is not None, out[-4000:]
    matrices = 4 if "--num-experts" in extra else 10 if "--canzona-split-gate-up" in extra else 8
    cp = 2 if "--context-parallel-size" in extra else 1
    assert (int(plan[1]), int(plan[2]), int(plan[3] or 1), int(plan[4])) == (matrices, nproc // tp // cp, cp, tp)
    if "--num-experts" in extra:  # each EP rank's 2 experts of 2 layers, fc1 and fc2, hosted over expert-DP 2
        assert "[canzona] experts: 8 matrices per EP rank over expert-DP 2 x EP 2, 2 bucket(s)" in out, out[-4000:]
    assert "[canzona] early compute: off (auto: on gloo the host computes serially" in out
    assert "Traceback" not in out


def test_sync_and_async_host_groups_are_bitwise_equal(runs: dict) -> None:
    """The engine's two modes order the same gathers and computations differently (``async``
    gathers in backward, as each bucket's last reduce-scatter ends): every logged loss and
    gradient norm is the same float. So is early compute's, which says it is on."""
    first = runs[next(iter(CASES))]["metrics"]
    for other in ("sync", "early_compute"):
        assert {i: (m["lm_loss"], m["grad_norm"]) for i, m in runs[other]["metrics"].items()} == \
            {i: (m["lm_loss"], m["grad_norm"]) for i, m in first.items()}, other
    assert "[canzona] early compute: on (--canzona-early-compute on)" in runs["early_compute"]["stdout"]


@pytest.mark.parametrize("name", list(CASES))
def test_each_ranks_optimizer_state_is_the_memory_models(runs: dict, name: str) -> None:
    """What every rank holds after its last step, by kind, is what
    ``megatron.canzona.planning.memory.fsdp_state_elements`` predicts for it from the plan: Muon's
    momentum (AdaMuon's too) in FSDP's shard layout on the holders, none on the hosts; AdamW's
    moments for the elementwise elements each rank holds; the rest of the matrix state on hosts.
    (The balance across ranks is a property of the plan at scale: tests/unit/test_planning_fsdp.py.)"""
    _, optimizer, _, _ = CASES[name]
    paths = sorted((runs[name]["dir"] / "geometry").glob("state*.json"))
    states = [json.loads(p.read_text()) for p in paths]
    experts = "--num-experts" in CASES[name][3]  # and each rank's expert optimizer's: its matrices only
    assert len(states) == CASES[name][0] * (1 + experts) and sum("experts" in p.name for p in paths) == experts * len(paths) // 2
    for state in states:
        assert state["measured"] == state["predicted"]
        assert state["momentum_on_holders"] == (optimizer in ("muon", "adaptive_muon"))
    if optimizer == "muon":  # nothing on the hosts: AdamW-FSDP's two moments of a shard at most
        assert all(set(s["measured"]) == ({"momentum"} if "experts" in p.name else {"momentum", "adam_moments"})
                   for p, s in zip(paths, states))


DRY_RUN_UNEXPRESSED = ("--canzona-split-gate-up",)
"""Flags of the runs that ``tools/dry_run.py`` has no counterpart of (their cases are left out)."""


def _dry_run_flags(name: str, geometry: dict) -> list[str]:
    """``dry_run.py --fsdp`` flags of case ``name``: its flags, and the padded vocabulary of its
    tokenizer as its rank 0 recorded it."""
    nproc, optimizer, strategy, extra = CASES[name]
    value = {flag: extra[i + 1] for i, flag in enumerate(extra[:-1]) if flag.startswith("--")}
    tp, cp, ep = (int(value.get(f"--{k}-parallel-size", 1)) for k in ("tensor-model", "context", "expert-model"))
    vocab = next(s["global_shape"][0] for s in geometry["specs"] if s["name"].endswith("word_embeddings.weight"))
    flags = ["--fsdp", "--data-parallel-sharding-strategy", strategy, "--optimizer", optimizer,
             "--model", "qwen3-moe-tiny" if "--num-experts" in extra else "qwen3-tiny", "--vocab-size", str(vocab),
             "--tp", str(tp), "--cp", str(cp), "--ep", str(ep), "--dp", str(nproc // (tp * cp)), "--every-rank",
             "--fsdp-micro-groups", "budget",  # a CPU run's (auto projects only on CUDA)
             # --bf16 reduces in fp32 (Megatron's --accumulate-allreduce-grads-in-fp32), as the plan prices it
             *(("--params-dtype", "bf16", "--grad-reduce-in-fp32") if "--bf16" in extra else ("--params-dtype", "fp32")),
             *(("--narrow-gathers",) if NARROW in extra else ()),
             *(FP32_NS if FP32_NS[0] in extra else ())]
    return flags + (["--bucket-size", value["--ddp-bucket-size"]] if "--ddp-bucket-size" in value else [])


def _dry_run_differences(name: str, geometry_dir, report: dict) -> list[str]:
    """What differs between ``dry_run.py --fsdp``'s ``report`` for case ``name`` and what its run's
    ranks recorded (empty: nothing)."""
    ranks = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in geometry_dir.glob("rank*.json")}
    assert len(ranks) == CASES[name][0], sorted(ranks)
    predicted = {r["rank"]: r for r in report["ranks"]}
    problems = []
    if report["config"]["bucket_size"] != ranks[0]["bucket_size"]:  # Megatron's default, or the run's flag
        problems.append(f"bucket size: the run's {ranks[0]['bucket_size']}, predicted {report['config']['bucket_size']}")
    planned = sorted((b["size"], b["dp_size"], b["chunk"], b["expert"], b["items"]) for b in report["bucket_geometry"])
    for rank, geometry in sorted(ranks.items()):
        built = sorted((b["size"], b["dp_size"], b["chunk"], b["expert"], len(b["items"])) for b in geometry["buckets"])
        if built != planned:
            problems.append(f"rank {rank} buckets: built {built}, predicted {planned}")
        for part, suffix in (("dense", ""), ("experts", "-experts")):
            path = geometry_dir / f"state{rank}{suffix}.json"
            record = json.loads(path.read_text()) if path.exists() else {}
            measured, expected = record.get("measured"), predicted[rank][part]
            if measured != (None if expected is None else {kind: n for kind, n in expected.items() if n}):
                problems.append(f"rank {rank} {part} state: measured {measured}, predicted {expected}")
            if record.get("in_flight") != predicted[rank]["in_flight"][part]:
                problems.append(f"rank {rank} {part} step buffers: measured {record.get('in_flight')}, "
                                f"predicted {predicted[rank]['in_flight'][part]}")
    return problems


def test_dry_runs_fsdp_prediction_is_what_every_rank_measured(runs: dict) -> None:
    """``tools/dry_run.py --fsdp --every-rank`` for each case it can express (all but gate and up
    hosted apart), against what every rank of the case's run recorded (``fsdp_geometry_traced.py``):
    the optimizer state each rank holds after its last step by kind, counted from its tensors (the
    expert optimizer's apart), the step's buffers (its largest, the most alive at once, every early
    gather's) as its host-group engine counts them, the buckets read from the buffers Megatron-FSDP
    built, and the bucket size Megatron gave it. The dry runs share one process (``fsdp_dry_runs.py``)."""
    names = [name for name in CASES if not any(flag in CASES[name][3] for flag in DRY_RUN_UNEXPRESSED)]
    geometry = {name: runs[name]["dir"] / "geometry" for name in names}
    argvs = [_dry_run_flags(name, json.loads((geometry[name] / "rank0.json").read_text())) for name in names]
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "fsdp_dry_runs.py")], input=json.dumps(argvs),
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    replies = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert len(replies) == len(names) >= 8, (names, done.stdout[-2000:])
    for name, reply in zip(names, replies):
        assert reply["code"] == 0, (name, reply["errors"])
    problems = {name: _dry_run_differences(name, geometry[name], reply["report"]) for name, reply in zip(names, replies)}
    assert not any(problems.values()), problems


@pytest.mark.parametrize("name", list(RESUMES))
def test_canzona_under_megatron_fsdp_resumes_from_its_fsdp_dtensor_checkpoints(runs: dict, name: str) -> None:
    """Iterations 3 and 4 resumed from iteration 2's ``fsdp_dtensor`` checkpoint against the
    uninterrupted run (RESUMES: bitwise at the same layout, within tolerance at another)."""
    saved, nproc, extra = RESUMES[name]
    same = (nproc, extra) == (CASES[saved][0], CASES[saved][3])
    straight, resumed = runs[saved]["metrics"], runs[name]["metrics"]
    assert sorted(resumed) == [3, 4]
    largest = max(abs(m["lm_loss"]) for m in straight.values())
    worst_loss = worst_norm = 0.0
    for iteration, got in resumed.items():
        want = straight[iteration]
        if same:
            assert (got["lm_loss"], got["grad_norm"]) == (want["lm_loss"], want["grad_norm"]), (name, iteration)
        else:
            assert abs(got["lm_loss"] - want["lm_loss"]) <= LOSS_RTOL["muon"] * largest, (name, iteration)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=GRAD_NORM_RTOL), (name, iteration)
        worst_loss = max(worst_loss, abs(got["lm_loss"] / want["lm_loss"] - 1))
        worst_norm = max(worst_norm, abs(got["grad_norm"] / want["grad_norm"] - 1))
    print(f"[canzona-fsdp] resume {name}: largest relative difference, losses {worst_loss:.1e}, "
          f"grad norms {worst_norm:.1e}")
    assert "[canzona] plan: fsdp layout" in runs[name]["stdout"]


def test_a_checkpoint_of_another_optimizer_is_named_in_one_line(runs: dict) -> None:
    """Muon's checkpoint resumed with --optimizer shampoo: every rank stops with one line naming the
    saved optimizer and the two ways on, before anything is read."""
    result = runs["wrong_optimizer"]
    assert result.returncode != 0
    line = "the checkpoint holds muon state, this run uses --optimizer shampoo: resume with --optimizer muon"
    assert line in result.stdout, result.stdout[-3000:]
    assert "Traceback" not in result.stdout


FAULTY_ENTRY = "canzona_patches/harness/pretrain_with_fault.py"
TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def killed_save(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Muon at DP 2 (``optim_grads_params``) saving every 2 iterations, rank 0 SIGKILLed while it
    commits iteration 4 (everything written, before the rename: ``CANZONA_CKPT_FAULT=commit@4``);
    the job resumed from the same directory; then iteration 4's checkpoint, one byte flipped in a
    data file, loaded by 2 ranks."""
    root = tmp_path_factory.mktemp("fsdp_killed")
    ckpt = root / "ckpt"
    flags = (*_canzona("muon", *FSDP), "--data-parallel-sharding-strategy", "optim_grads_params", *FP32_NS,
             "--save", str(ckpt), "--save-interval", "2")
    out = {"killed": launch_ranks(2, FAULTY_ENTRY, *train_args(demo_data, root / "killed", *flags),
                                  timeout_s=RUN_TIMEOUT_S, env={"CANZONA_CKPT_FAULT": f"commit@{ITERS}"})}
    out["after_kill"] = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".staging"))
    out["tracker_after_kill"] = (ckpt / TRACKER).read_text()
    out["reference"] = {m["iteration"]: m for m in map(json.loads, (root / "killed" / "metrics.jsonl").read_text().splitlines())}
    out["resumed"] = train(demo_data, root / "resumed", 2, *flags, "--load", str(ckpt))
    out["after_resume"] = sorted(p.name for p in ckpt.iterdir())
    final = ckpt / f"iter_{ITERS:07d}"
    out["files"] = sorted(p.name for p in final.iterdir() if p.is_file())
    out["listed"] = sorted(p.name.removesuffix(".sha256") for p in (final / "checksums").glob("*.sha256"))
    out["checksums_hold"] = all(
        line.split()[0] == hashlib.sha256((final / line.split()[1]).read_bytes()).hexdigest()
        for listing in (final / "checksums").glob("*.sha256") for line in listing.read_text().splitlines())
    bad = root / "bad"
    shutil.copytree(ckpt, bad)
    victim = bad / final.name / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    out["victim"] = victim
    out["corrupt"] = launch_ranks(2, "pretrain_gpt.py", *train_args(
        demo_data, root / "corrupt", *_canzona("muon", *FSDP), "--data-parallel-sharding-strategy",
        "optim_grads_params", *FP32_NS, "--load", str(bad)), timeout_s=RUN_TIMEOUT_S)
    return out


def test_a_save_killed_under_fsdp_never_tears_the_tracked_checkpoint(killed_save: dict, runs: dict) -> None:
    """The torn attempt is never tracked (the tracker still names iteration 2, no ``iter_0000004``);
    the resumed job continues from iteration 2 bitwise the uninterrupted run of the same flags
    (``muon-dp2-optim_grads_params``, which the killed one follows while it lives: its last rank
    may be stopped before it logs iteration 4, as its rank 0 dies committing) and saves iteration 4
    in place of the torn attempt, its staging gone."""
    assert killed_save["killed"].returncode != 0
    assert killed_save["after_kill"] == ["canzona.lock", "iter_0000002", TRACKER]
    assert killed_save["tracker_after_kill"].strip() == "2"
    resumed, killed = killed_save["resumed"]["metrics"], killed_save["reference"]
    straight = runs["muon-dp2-optim_grads_params"]["metrics"]
    assert sorted(resumed) == [3, 4] and set(range(1, ITERS)) <= set(killed)
    for iteration, got in (*killed.items(), *resumed.items()):
        assert (got["lm_loss"], got["grad_norm"]) == (straight[iteration]["lm_loss"], straight[iteration]["grad_norm"])
    assert killed_save["after_resume"] == ["iter_0000002", f"iter_{ITERS:07d}", TRACKER]


def test_fsdp_dtensor_checkpoints_carry_checksums_that_name_a_flipped_byte(killed_save: dict) -> None:
    """Every file of an ``fsdp_dtensor`` checkpoint (each rank's data file, the index) has its SHA-256,
    recorded as torch DCP wrote it; a byte flipped in a data file stops every rank with one line
    naming the file and the way on, before anything is read."""
    assert killed_save["listed"] == killed_save["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert killed_save["checksums_hold"]
    result = killed_save["corrupt"]
    assert result.returncode != 0
    line = f"{killed_save['victim']} is corrupt: its SHA-256 is "
    assert line in result.stdout and "resume from it with --ckpt-step 2" in result.stdout, result.stdout[-3000:]
    assert "Traceback" not in result.stdout
