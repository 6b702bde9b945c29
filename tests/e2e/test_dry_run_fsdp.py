"""``tools/dry_run.py --fsdp`` against what CPU runs of ``--canzona --use-megatron-fsdp`` measured.

The prediction of ``dry_run.py --fsdp --every-rank --json`` for the tiny model, at each layout of
``tests/e2e/test_canzona_fsdp.py`` it can express, is held to what every rank of that file's runs
recorded through ``fsdp_geometry_traced.py``: the optimizer state each rank holds after its last
step, by kind, counted from its tensors (``state<r>.json``, ``state<r>-experts.json`` for the
expert optimizer) and the buckets read from the buffers Megatron-FSDP built (``rank<r>.json``).

It starts no run of its own: it reads the output those runs leave in the session's temporary
directory, so it runs after ``test_canzona_fsdp.py`` in the same session (``make test-all``; pytest
takes the files in name order) and is skipped where that file did not run first.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .support import ROOT
from .test_canzona_fsdp import CASES

pytestmark = pytest.mark.slow

TIMEOUT_S = 120
UNEXPRESSED = ("--canzona-split-gate-up",)
"""Flags of the runs that ``dry_run.py`` has no counterpart of (their cases are left out)."""


def dry_run_flags(name: str, geometry: dict) -> tuple[str, ...]:
    """``dry_run.py --fsdp`` flags of case ``name`` of test_canzona_fsdp.py: its flags, and the padded
    vocabulary of its tokenizer as its rank 0 recorded it."""
    nproc, optimizer, strategy, extra = CASES[name]
    value = {flag: extra[i + 1] for i, flag in enumerate(extra[:-1]) if flag.startswith("--")}
    tp, cp, ep = (int(value.get(f"--{k}-parallel-size", 1)) for k in ("tensor-model", "context", "expert-model"))
    vocab = next(s["global_shape"][0] for s in geometry["specs"] if s["name"].endswith("word_embeddings.weight"))
    flags = ["--fsdp", "--data-parallel-sharding-strategy", strategy, "--optimizer", optimizer,
             "--model", "qwen3-moe-tiny" if "--num-experts" in extra else "qwen3-tiny", "--vocab-size", str(vocab),
             "--tp", str(tp), "--cp", str(cp), "--ep", str(ep), "--dp", str(nproc // (tp * cp)),
             # --bf16 reduces in fp32 (Megatron's --accumulate-allreduce-grads-in-fp32), as the plan prices it
             *(("--params-dtype", "bf16", "--grad-reduce-in-fp32") if "--bf16" in extra else ("--params-dtype", "fp32"))]
    if "--ddp-bucket-size" in value:
        flags += ["--bucket-size", value["--ddp-bucket-size"]]
    return tuple(flags)


def recorded_runs(basetemp: Path) -> Path | None:
    """The directory test_canzona_fsdp.py's runs wrote in this session, if they did."""
    found = sorted((p for p in basetemp.glob("canzona_fsdp*") if p.name.removeprefix("canzona_fsdp").isdigit()),
                   key=lambda p: int(p.name.removeprefix("canzona_fsdp")))
    return found[-1] if found else None


@functools.lru_cache(maxsize=None)  # runs whose flags differ only in what dry_run has no counterpart of
def predict(flags: tuple[str, ...]) -> dict:
    out = subprocess.run([sys.executable, "tools/dry_run.py", *flags, "--every-rank", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def nonzero(kinds: dict | None) -> dict:
    return {kind: n for kind, n in (kinds or {}).items() if n}


def compare(name: str, geometry_dir: Path) -> list[str]:
    """What differs between the prediction of case ``name`` and its run's records (empty: nothing)."""
    ranks = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in geometry_dir.glob("rank*.json")}
    assert len(ranks) == CASES[name][0], sorted(ranks)
    report = predict(dry_run_flags(name, ranks[0]))
    predicted = {r["rank"]: r for r in report["ranks"]}
    problems = []
    if report["config"]["bucket_size"] != ranks[0]["bucket_size"]:  # Megatron's default, or the run's flag
        problems.append(f"bucket size: the run's {ranks[0]['bucket_size']}, predicted {report['config']['bucket_size']}")
    for rank, geometry in sorted(ranks.items()):
        built = [(b["size"], b["dp_size"], b["chunk"], b["expert"], len(b["items"])) for b in geometry["buckets"]]
        planned = [(b["size"], b["dp_size"], b["chunk"], b["expert"], b["items"]) for b in report["bucket_geometry"]]
        if sorted(built) != sorted(planned):
            problems.append(f"rank {rank} buckets: built {built}, predicted {planned}")
        for part, suffix in (("dense", ""), ("experts", "-experts")):
            path = geometry_dir / f"state{rank}{suffix}.json"
            measured = json.loads(path.read_text())["measured"] if path.exists() else None
            if measured != (nonzero(predicted[rank][part]) if predicted[rank][part] is not None else None):
                problems.append(f"rank {rank} {part} state: measured {measured}, predicted {predicted[rank][part]}")
    return problems


@pytest.mark.timeout(TIMEOUT_S * len(CASES) + 60)
def test_dry_runs_fsdp_prediction_is_what_every_rank_of_the_cpu_runs_measured(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    root = recorded_runs(tmp_path_factory.getbasetemp())
    if root is None:
        pytest.skip("reads the runs of tests/e2e/test_canzona_fsdp.py: run that file first in the same session "
                    "(pytest tests/e2e/test_canzona_fsdp.py tests/e2e/test_dry_run_fsdp.py)")
    names = [name for name in CASES if (root / name / "geometry").is_dir()]
    expressed = [name for name in names if not any(flag in CASES[name][3] for flag in UNEXPRESSED)]
    assert len(expressed) >= 8, f"test_canzona_fsdp.py's runs left too few cases in {root}: {names}"
    problems = {name: compare(name, root / name / "geometry") for name in expressed}
    assert not any(problems.values()), problems
