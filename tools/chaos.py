#!/usr/bin/env python
"""Chaos soak: kill ranks and the launcher at random moments, resume each time, and prove the
end state is bitwise the uninterrupted run's; or (``--bad-input``) feed it careless inputs.

    python tools/chaos.py                                  # 60 faults of six kinds over 4 scenarios, 300 iterations each
    python tools/chaos.py --faults 2 --kinds rank-in-step,launcher-in-save --scenarios muon-async --train-iters 9   # short
    python tools/chaos.py --bad-input                      # 46 careless inputs, a table of what each got (~7 min)

``--bad-input`` runs the tiny recipe (2 CPU ranks) once per input of :data:`BAD_INPUTS` (flags
Megatron or Canzona refuse, flags the run would not read, settings out of range, damaged data or
checkpoints, resumes that cannot work, files named wrong, a job told to stop, a rank that stops
answering, a data file cut short under the job; a tool's negative size runs that tool instead) and
classifies what the user got: *one line* (a non-zero exit with one error line, torchrun's own
failure report aside), *saved* (a stop that must save did: the checkpoint at the iteration it came
in or later, every rank exiting 0), *traceback* (a rank's, whether or not torch put ``[rankN]: ``
before its lines), *silent* (exit 0, or no error line), *hang* (no exit within ``--launch-timeout``),
*loss* (the checkpoint resumed from changed, or a stop that did not save); how many times the line
was printed, and its length. It exits 0 only if every input got what it expects (one line, or
saved), printed once, in at most 300 characters.

Each scenario (``muon``, ``muon-async``, ``shampoo``, ``shampoo-async``: the optimizer, with or
without ``--async-save``) trains the tiny Qwen3 recipe (``examples/qwen3/pretrain_qwen3_tiny.sh``,
``--canzona``, TP 2 x DP 2 by default: four gloo ranks; ``--tp``/``--dp`` choose) twice from the same data:

1. **reference**: once, uninterrupted, to ``--train-iters``;
2. **chaos**: launched again and again on one ``--save``/``--load`` directory (the requeue
   pattern) while faults are left; each launch gets one fault, one of

   * ``rank``: SIGKILL a random rank at a random moment of a random iteration;
   * ``rank-in-step``: a random rank kills itself inside the optimizer step of a random
     iteration, having updated part of its matrices (``step@<iteration>:<rank>`` of
     ``canzona_patches/harness/faults.py``, armed by ``pretrain_with_fault.py`` as ``ENTRY``);
   * ``launcher``: SIGKILL torchrun itself at such a moment (its ranks must end on their own);
   * ``rank-in-save`` / ``launcher-in-save``: the same, as soon as a checkpoint's staging
     directory appears (a save being written);
   * ``rank-after-save``: a random rank, right after a save was committed (between saves);

   after each, every rank must be gone within ``--exit-timeout`` seconds, and the tracked
   checkpoint must exist and pass its checksums (else it counts as *lost*). Once the faults are
   spent, the last launch runs to the end and must exit 0.

Then the two final checkpoints are compared tensor by tensor (model weights, optimizer state,
step counters): bitwise, since the layout is the same. Prints a table (faults by kind, resumes,
iterations replayed, tensors compared, mismatches, lost checkpoints) and one JSON object with the
configuration, git revision and machine; exits 1 on any mismatch, loss, hang or failed run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from canzona_patches.version import quiet_megatron_notices
from megatron.canzona.cli import ArgumentParser, at_least, positive
from megatron.canzona.provenance import git_revision, machine
from megatron.canzona.runtime.launcher import free_port
from megatron.canzona.runtime.lifetime import end_session, ranks_of, running

ROOT = Path(__file__).resolve().parents[1]

RECIPE = ROOT / "examples" / "qwen3" / "pretrain_qwen3_tiny.sh"
TRACKER = "latest_checkpointed_iteration.txt"
KINDS = ("rank", "rank-in-step", "launcher", "rank-in-save", "launcher-in-save", "rank-after-save")
ARMED_ENTRY = ROOT / "canzona_patches" / "harness" / "pretrain_with_fault.py"
"""``pretrain_gpt.py`` with the ``CANZONA_CKPT_FAULT`` of its environment armed (``rank-in-step``)."""
FIRED = "[test fault]"
SCENARIOS = {"muon": ("muon", False), "muon-async": ("muon", True),
             "shampoo": ("shampoo", False), "shampoo-async": ("shampoo", True)}
ITERATION = re.compile(r"iteration +(\d+)/ *\d+ \|")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=at_least(0), default=60, help="faults in all, spread over the scenarios")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--train-iters", type=at_least(1), default=300)
    parser.add_argument("--save-interval", type=at_least(1), default=10)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated fault kinds, of {', '.join(KINDS)}")
    parser.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=at_least(1), default=2,
                        help="tensor-parallel size of every launch")
    parser.add_argument("--dp", "--data-parallel-size", dest="dp", type=at_least(1), default=2,
                        help="data-parallel size: TP x DP gloo ranks a launch")
    parser.add_argument("--seed", type=int, default=0, help="seeds the choice of faults, ranks and moments")
    parser.add_argument("--data-path", help="dataset prefix (default: the recipe's demo data, made if missing)")
    parser.add_argument("--tokenizer-model", help="SentencePiece model of --data-path")
    parser.add_argument("--launch-timeout", type=positive, default=600.0, help="seconds one launch may take")
    parser.add_argument("--exit-timeout", type=positive, default=30.0, help="seconds the ranks get to end after a fault")
    parser.add_argument("--dir", help="where runs go (default: a temporary directory, removed)")
    parser.add_argument("--json", metavar="FILE", help="also write the JSON result here")
    parser.add_argument("--bad-input", action="store_true",
                        help="instead of faults, run a table of careless inputs (flags, data, resumes) and count "
                        "their outcomes: one line, traceback, silent, hang, loss")
    parser.add_argument("--bad-cases", help="with --bad-input: comma-separated names of its table (default: all)")
    parser.add_argument("--markdown", metavar="FILE", help="with --bad-input: also write the table of outcomes as "
                        "Markdown here (docs/bad_input.md's), the runs' directory shortened to …")
    args = parser.parse_args(argv)
    if args.bad_cases and any(c.strip() not in {b.name for b in BAD_INPUTS} for c in args.bad_cases.split(",")):
        parser.error(f"--bad-cases {args.bad_cases!r}: choose from {', '.join(b.name for b in BAD_INPUTS)}")
    args.scenario_names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in args.scenario_names if s not in SCENARIOS]
    if unknown or not args.scenario_names:
        parser.error(f"--scenarios {args.scenarios!r}: choose from {', '.join(SCENARIOS)}")
    args.ranks = args.tp * args.dp
    args.kind_names = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not args.kind_names or any(k not in KINDS for k in args.kind_names):
        parser.error(f"--kinds {args.kinds!r}: choose from {', '.join(KINDS)}")
    if args.faults < 0 or args.train_iters < 2 or not 1 <= args.save_interval < args.train_iters:
        parser.error("--faults must be at least 0, --train-iters at least 2, and --save-interval in [1, --train-iters)")
    if (args.data_path is None) != (args.tokenizer_model is None):
        parser.error("--data-path and --tokenizer-model go together")
    return args


# --------------------------------------------------------------------------- one launch


class Launch:
    """One run of the recipe in its own session; its output goes to ``log`` line by line."""

    def __init__(self, env: dict[str, str], log: Path, extra: list[str]) -> None:
        self.log = log
        self.reached = 0
        """The last iteration the job logged (kept by the reader, so polling it costs nothing)."""
        self.ranks: list[int] = []
        """The ranks alive when a fault fired (they must all end)."""
        self.fired_at: int | None = None
        """The last iteration logged before a rank armed with a fault announced it."""
        self.process = subprocess.Popen(["bash", str(RECIPE), *extra], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log, "w") as out:
            for line in self.process.stdout:
                out.write(line)
                logged = ITERATION.search(line)
                if logged:
                    self.reached = max(self.reached, int(logged[1]))
                elif line.startswith(FIRED) and self.fired_at is None:
                    self.fired_at = self.reached

    def rank_pids(self) -> list[int]:
        """The ranks torchrun started (its children with a ``LOCAL_RANK``)."""
        return list(ranks_of(self.process.pid).values())

    def running(self) -> bool:
        return self.process.poll() is None

    def kill_all(self) -> None:
        end_session(self.process)
        self._reader.join(timeout=10)



# --------------------------------------------------------------------------- a scenario


@dataclass
class Tally:
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    resumes: int = 0
    replayed: int = 0
    compared: int = 0
    mismatches: list[str] = field(default_factory=list)
    rng_differ: int = 0
    """Saved RNG states (not model or optimizer state) that differ: reported, not a mismatch."""
    planned: int = 0
    lost: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    launches: int = 0


class Scenario:
    def __init__(self, name: str, args: argparse.Namespace, root: Path, rng: random.Random) -> None:
        self.name, self.args, self.root, self.rng = name, args, root / name, rng
        self.optimizer, self.asynchronous = SCENARIOS[name]
        self.tally = Tally()

    def env(self, run: str) -> dict[str, str]:
        args = self.args
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TP": str(args.tp),
               "NPROC_PER_NODE": str(args.ranks),
               "OPTIMIZER": self.optimizer, "TRAIN_ITERS": str(args.train_iters),
               "SAVE_INTERVAL": str(args.save_interval), "LOG_INTERVAL": "1", "EVAL_INTERVAL": "100000",
               "EVAL_ITERS": "0", "WARMUP_ITERS": "2", "LOG_DIR": str(self.root / run),
               "CKPT_DIR": str(self.root / run / "ckpt"), "MASTER_PORT": str(free_port())}
        if args.data_path:
            env.update(DATA_PATH=args.data_path, TOKENIZER_MODEL=args.tokenizer_model, SPLIT="80,10,10")
        return env

    def launch(self, run: str, armed: str | None = None) -> Launch:
        """One launch; ``armed``, a fault of ``canzona_patches/harness/faults.py`` its ranks arm."""
        self.tally.launches += 1
        log = self.root / run / f"launch_{self.tally.launches:03d}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = self.env(run)
        if armed:
            env.update(ENTRY=str(ARMED_ENTRY), CANZONA_CKPT_FAULT=armed)
        return Launch(env, log, ["--async-save"] if self.asynchronous else [])

    def reference(self) -> Path:
        launch = self.launch("reference")
        code = self._wait(launch, self.args.launch_timeout)
        if code != 0:
            raise RuntimeError(f"{self.name}: the uninterrupted run failed ({code}); see {launch.log}")
        return self.root / "reference" / "ckpt"

    def chaos(self, faults: list[str]) -> Path:
        ckpt = self.root / "chaos" / "ckpt"
        pending = list(faults)
        while True:
            launch = self.launch("chaos", self._armed(pending[0], ckpt, len(pending)) if pending else None)
            if not pending:
                code = self._wait(launch, self.args.launch_timeout)
                if code != 0:
                    raise RuntimeError(f"{self.name}: the last chaos launch failed ({code}); see {launch.log}")
                return ckpt
            kind = pending[0]
            fired = self._inject(launch, kind, ckpt, len(pending))
            if fired is None:  # the run ended before the fault's moment came
                code = self._wait(launch, self.args.launch_timeout)
                if code != 0:
                    raise RuntimeError(f"{self.name}: a chaos launch failed without a fault ({code}); see {launch.log}")
                return ckpt
            pending.pop(0)
            self.tally.faults[kind] += 1
            self._after_fault(launch, fired, ckpt)
            self.tally.resumes += 1

    def _moment(self, first: int, left: int) -> int:
        """A random iteration from ``first`` on for the next of ``left`` faults: the faults spread
        over the run (each within twice its share of the iterations still to run, or of two saves)."""
        span = max(2 * self.args.save_interval, 2 * (self.args.train_iters - first) // (left + 1))
        return self.rng.randint(first, max(first, min(first + span - 1, self.args.train_iters - 1)))

    def _armed(self, kind: str, ckpt: Path, left: int) -> str | None:
        """The fault the ranks arm for ``kind`` (only ``rank-in-step``): a random rank, in the step
        of a random iteration (:meth:`_moment`) after the one the launch resumes from."""
        if kind != "rank-in-step":
            return None
        iteration = self._moment(_tracked_iteration(ckpt) + 1, left)
        return f"step@{iteration}:{self.rng.randrange(self.args.ranks)}"

    def _inject(self, launch: Launch, kind: str, ckpt: Path, left: int) -> int | None:
        """Wait for the fault's moment and fire it; the iteration reached, or None if the run ended first."""
        deadline = time.monotonic() + self.args.launch_timeout
        target = None
        committed_at = stale = None
        while time.monotonic() < deadline:
            if kind == "rank-in-step" and len(launch.ranks) < self.args.ranks:
                launch.ranks = launch.rank_pids()  # the launch's ranks, to see that they all end
            if not launch.running():
                launch.kill_all()  # reads the log to its end
                return launch.fired_at
            if launch.fired_at is not None:
                return launch.fired_at
            reached = launch.reached
            if target is None and reached:
                target = self._moment(reached, left)  # from the first iteration this launch logged
            if target is not None and reached >= target:
                if kind in ("rank", "launcher"):
                    time.sleep(self.rng.uniform(0.0, 1.0))  # somewhere in the next iteration
                    return self._fire(launch, kind, launch.reached)
                if committed_at is None:  # from here on, the next save
                    committed_at = _mtime(ckpt / TRACKER)
                    stale = _staging_inodes(ckpt)  # a killed save's leftovers, or one under way
                if kind.endswith("-in-save") and _staging_inodes(ckpt) - stale:
                    return self._fire(launch, kind, reached)
                if kind == "rank-after-save" and _mtime(ckpt / TRACKER) > committed_at:
                    return self._fire(launch, kind, reached)
            time.sleep(0.005)
        raise RuntimeError(f"{self.name}: no moment for a '{kind}' fault within {self.args.launch_timeout} s")

    def _fire(self, launch: Launch, kind: str, reached: int) -> int:
        ranks = launch.rank_pids()
        victim = launch.process.pid if kind.startswith("launcher") else self.rng.choice(ranks)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launch.ranks = ranks
        return reached

    def _after_fault(self, launch: Launch, reached: int, ckpt: Path) -> None:
        deadline = time.monotonic() + self.args.exit_timeout
        ranks = launch.ranks
        while time.monotonic() < deadline and (any(running(p) for p in ranks) or launch.running()):
            time.sleep(0.05)
        survivors = [p for p in ranks if running(p)]
        if survivors or launch.running():
            self.tally.failures.append(f"ranks {survivors} outlived the fault by {self.args.exit_timeout} s")
        launch.kill_all()
        resumed_from = _tracked_iteration(ckpt)
        self.tally.replayed += max(0, reached - resumed_from)
        if resumed_from:
            problem = _checkpoint_problem(ckpt / f"iter_{resumed_from:07d}")
            if problem:
                self.tally.lost.append(problem)

    def _wait(self, launch: Launch, timeout: float) -> int:
        try:
            code = launch.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            launch.kill_all()
            raise RuntimeError(f"{self.name}: a launch hung for {timeout} s; see {launch.log}") from None
        launch.kill_all()
        return code


def _staging_inodes(ckpt: Path) -> set[int]:
    """The staging directories of saves in ``ckpt`` (by inode: a re-save reuses the name)."""
    found = set()
    try:
        for path in ckpt.iterdir():
            if path.name.startswith(".staging-iter_"):
                found.add(path.stat().st_ino)
    except OSError:
        pass
    return found


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _tracked_iteration(ckpt: Path) -> int:
    try:
        return int((ckpt / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return 0


def _checkpoint_problem(path: Path) -> str | None:
    from canzona_patches.checkpoints.checksums import first_mismatch

    if not path.is_dir():
        return f"{path} is tracked but missing"
    if not (path / "checksums").is_dir():
        return f"{path} has no checksums"
    return first_mismatch(path, 0, 1)


# --------------------------------------------------------------------------- comparing


def compare(reference: Path, chaos: Path, tally: Tally) -> None:
    """Every tensor of the two final checkpoints, bitwise. The saved RNG states are counted
    apart: on CPU a resumed run's generator state drifts from the uninterrupted run's (see
    tests/e2e/test_resume.py: CPU resumes with dropout are not bitwise), which the model and
    optimizer state, compared here, do not depend on with dropout off."""
    import torch

    left, right = checkpoint_tensors(reference), checkpoint_tensors(chaos)
    if left.keys() != right.keys():
        tally.mismatches.append(f"keys differ: {sorted(left.keys() ^ right.keys())[:5]}")
    for key in sorted(left.keys() & right.keys()):
        a, b = left[key], right[key]
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        if key.startswith("rng_state/"):
            tally.rng_differ += not same
            continue
        tally.compared += 1
        if not same:
            tally.mismatches.append(key)


def checkpoint_tensors(ckpt: Path) -> dict:
    """The tensors of the tracked checkpoint of ``ckpt``, by key."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = ckpt / f"iter_{_tracked_iteration(ckpt):07d}"
    with tempfile.TemporaryDirectory() as scratch:
        flat = Path(scratch) / "state.pt"
        dcp_to_torch_save(str(path), str(flat))
        state = torch.load(flat, weights_only=False)
    found: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            found[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)

    walk("", state)
    return found


# --------------------------------------------------------------------------- main


def plan_faults(total: int, scenarios: list[str], kinds_used: list[str], rng: random.Random) -> dict[str, list[str]]:
    """``total`` faults dealt to the scenarios in turn; every kind as often as the others (± 1)."""
    kinds = [kinds_used[i % len(kinds_used)] for i in range(total)]
    rng.shuffle(kinds)
    dealt: dict[str, list[str]] = {name: [] for name in scenarios}
    for i, kind in enumerate(kinds):
        dealt[scenarios[i % len(scenarios)]].append(kind)
    return dealt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_megatron_notices()  # the checksum check and the comparison import Megatron-Core
    if args.bad_input:
        return bad_input(args)
    rng = random.Random(args.seed)
    root = Path(args.dir or tempfile.mkdtemp(prefix="chaos_"))
    dealt = plan_faults(args.faults, args.scenario_names, args.kind_names, rng)
    print(f"chaos: {args.faults} faults over {', '.join(args.scenario_names)}; TP {args.tp} x DP {args.dp}, "
          f"{args.train_iters} iterations, a save every {args.save_interval}; runs in {root}", flush=True)
    started = time.perf_counter()
    results: dict[str, Tally] = {}
    try:
        for name in args.scenario_names:
            scenario = Scenario(name, args, root, rng)
            results[name] = scenario.tally
            scenario.tally.planned = len(dealt[name])
            began = time.perf_counter()
            try:
                reference = scenario.reference()
                chaos = scenario.chaos(dealt[name])
                compare(reference, chaos, scenario.tally)
            except RuntimeError as error:
                scenario.tally.failures.append(str(error))
            t = scenario.tally
            print(f"[chaos] {name}: {sum(t.faults.values())} of {t.planned} faults, {t.resumes} resumes, {t.replayed} iterations "
                  f"replayed, {t.compared} tensors compared, {len(t.mismatches)} mismatches, {len(t.lost)} lost, "
                  f"{len(t.failures)} failures ({time.perf_counter() - began:.0f} s)", flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - started
    print_table(results, wall)
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("scenario_names", "kind_names")}, "git_revision": git_revision(),
              "machine": machine(), "wall_seconds": wall,
              "scenarios": {name: vars(t) for name, t in results.items()}}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    bad = any(t.mismatches or t.lost or t.failures for t in results.values())
    return 1 if bad else 0


def print_table(results: dict[str, Tally], wall: float) -> None:
    short = {"rank": "rank", "rank-in-step": "rank@step", "launcher": "launch", "rank-in-save": "rank@save", "launcher-in-save": "launch@save",
             "rank-after-save": "rank@saved"}
    head = f"{'scenario':<14}" + "".join(f"{short[k]:>12}" for k in KINDS)
    print(head + f"{'faults':>8}{'planned':>8}{'resumes':>9}{'replayed':>10}{'tensors':>9}{'mismatch':>10}"
          f"{'lost':>6}{'failed':>8}{'rng≠':>6}")
    rows = list(results.items())
    total = Tally(faults={k: sum(t.faults[k] for _, t in rows) for k in KINDS},
                  resumes=sum(t.resumes for _, t in rows), replayed=sum(t.replayed for _, t in rows),
                  compared=sum(t.compared for _, t in rows),
                  mismatches=[m for _, t in rows for m in t.mismatches], lost=[x for _, t in rows for x in t.lost],
                  failures=[f for _, t in rows for f in t.failures], rng_differ=sum(t.rng_differ for _, t in rows),
                  planned=sum(t.planned for _, t in rows))
    for name, t in [*rows, ("total", total)]:
        print(f"{name:<14}" + "".join(f"{t.faults[k]:>12}" for k in KINDS)
              + f"{sum(t.faults.values()):>8}{t.planned:>8}{t.resumes:>9}{t.replayed:>10}{t.compared:>9}"
              + f"{len(t.mismatches):>10}{len(t.lost):>6}{len(t.failures):>8}{t.rng_differ:>6}")
    for name, t in rows:
        for line in t.mismatches[:5] + t.lost + t.failures:
            print(f"  {name}: {line}")
    print("faults < planned: the run reached --train-iters first. rng≠: saved RNG states that differ (not "
          "model or optimizer state; see compare())")
    print(f"wall time {wall / 60:.1f} min")


# --------------------------------------------------------------------------- bad input


@dataclass(frozen=True)
class BadInput:
    """One careless input to the tiny recipe (2 CPU ranks unless ``env`` says otherwise), or to a tool."""

    name: str
    kind: str
    """What is wrong: ``flags``, ``unread`` (a flag the run would not read, or one without its switch), ``range``
    (a setting out of its range), ``data``, ``resume``, ``files``, ``tools`` (a tool's option), ``nan`` (a run gone
    non-finite), ``skip`` (every step over the skip threshold), ``peer`` (a rank dies or stops answering) or
    ``preempt`` (the job is told to stop)."""
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    prepare: str | None = None
    """What :func:`_prepare` sets up first: ``cut-idx``, ``long-bin``, ``hf-dir``, ``sidecar``, ``checkpoint``
    (a copy of the seed run's checkpoints, iterations 1 and 2), ``checkpoint-normuon`` and ``checkpoint-no-optim``
    (the same saved with NorMuon, or with --no-save-optim), ``shard-cut``, ``tracker-missing`` (the seed's with
    iteration 2's shard cut short, its tracker naming iteration 9), ``save-file``
    (``--save`` a regular file), ``bin-copy`` (a copy of the demo data, for ``during``), ``calibration-cut`` or
    ``calibration-one-method``."""
    command: tuple[str, ...] = ()
    """A tool of ``tools/`` and its arguments, run instead of the recipe."""
    during: tuple[int, str] | None = None
    """Done once the run logs iteration N: ``(N, what)``, ``what`` one of ``sigterm-torchrun`` (as srun relays
    scancel), ``sigstop-rank1`` (a rank that stops answering) or ``cut-bin`` (the data's ``.bin`` cut to 4 KiB)."""
    expect: str = "one line"
    """The outcome that counts as handled: ``one line``, or ``saved`` (a stop that must save, exit 0 on every
    rank and resume: the tracker at N or later, the ``[canzona] SIGTERM`` line, no error line)."""


BAD_INPUTS = (
    BadInput("ranks-not-a-multiple-of-tp", "flags", env=(("NPROC_PER_NODE", "3"), ("TP", "2"))),
    BadInput("layers-not-split-by-pp", "flags", ("--pipeline-model-parallel-size", "2", "--num-layers", "3")),
    BadInput("positions-below-sequence", "flags", ("--max-position-embeddings", "16")),
    BadInput("micro-batch-0", "flags", ("--micro-batch-size", "0")),
    BadInput("experts-not-laid-out", "flags", ("--num-experts", "6", "--expert-model-parallel-size", "3")),
    BadInput("cp-sequence-not-divisible", "flags", ("--context-parallel-size", "2", "--seq-length", "66",
                                                    "--max-position-embeddings", "66")),
    BadInput("fp16-scale-overflows", "flags", ("--fp16",), env=(("TRAIN_ITERS", "6"), ("WARMUP_ITERS", "1"))),
    BadInput("metrics-file-unwritable", "files", ("--canzona-metrics-file", "/proc/canzona/metrics.jsonl")),
    BadInput("index-cut-short", "data", prepare="cut-idx"),
    BadInput("bin-of-another-dataset", "data", prepare="long-bin"),
    BadInput("load-a-typo", "resume", ("--load", "/nonexistent/checkpoints")),
    BadInput("load-a-hugging-face-dir", "resume", prepare="hf-dir"),
    BadInput("resume-with-another-optimizer", "resume", env=(("OPTIMIZER", "soap"),), prepare="checkpoint"),
    BadInput("resume-past-train-iters", "resume", env=(("TRAIN_ITERS", "1"), ("WARMUP_ITERS", "0")),
             prepare="checkpoint"),
    BadInput("resume-past-train-iters-overriding", "resume", ("--override-opt_param-scheduler",),
             env=(("TRAIN_ITERS", "1"), ("WARMUP_ITERS", "0")), prepare="checkpoint"),
    BadInput("edited-checksum-file", "resume", prepare="sidecar"),
    BadInput("canzona-flag-with-adamw", "unread", ("--canzona-split-gate-up",), env=(("VARIANT", "adamw"),)),
    BadInput("early-compute-budget-under-sync", "unread", ("--canzona-early-compute-budget", "3"),
             env=(("VARIANT", "sync"),)),
    BadInput("shampoo-flag-with-muon", "unread", ("--shampoo-epsilon", "1e-10")),
    BadInput("megatron-muon-flag-under-canzona", "unread", ("--muon-tp-mode", "distributed")),
    BadInput("cp-comm-type-misspelt", "unread", ("--context-parallel-size", "2", "--cp-comm-type", "all-gather")),
    BadInput("profile-file-without-iteration", "unread", ("--canzona-profile-file", "profile.json")),
    BadInput("calibration-cut-short", "files", ("--muon-ns-method", "auto"), prepare="calibration-cut"),
    BadInput("calibration-of-one-method", "files", ("--muon-ns-method", "auto"), prepare="calibration-one-method"),
    BadInput("tokenizer-vocab-beside-model", "files", env=(("TOKENIZER_MODEL", str(ROOT / "data" / "demo" /
                                                                                     "tokenizer.vocab")),)),
    BadInput("tokenizer-a-directory", "files", env=(("TOKENIZER_MODEL", str(ROOT / "data" / "demo")),)),
    BadInput("dry-run-negative-budget", "tools", command=("dry_run.py", "--model", "qwen3-tiny",
                                                          "--early-compute-budget", "-2")),
    BadInput("simulate-negative-gpus", "tools", command=("simulate.py", "--gpus", "-64")),
    BadInput("bench-step-negative-warmup", "tools", command=("bench_step.py", "--warmup", "-1")),
    BadInput("nan-with-the-check-off", "nan", ("--no-check-for-nan-in-loss-and-grad", "--init-method-std", "1e20")),
    BadInput("a-rank-dies-in-the-step", "peer", env=(("ENTRY", "canzona_patches/harness/pretrain_with_fault.py"),
                                                     ("CANZONA_CKPT_FAULT", "step@3:1"))),
    # A fourth round (issue 50): preemption, parse-time checks, a silent rank, the way on from a checkpoint.
    BadInput("sigterm-saves-under-the-exit-handler", "preempt", env=(("CKPT_DIR", "{work}/ckpt"),
                                                                     ("TRAIN_ITERS", "100000")),
             during=(3, "sigterm-torchrun"), expect="saved"),
    BadInput("sigterm-without-the-exit-handler", "preempt", env=(("CKPT_DIR", "{work}/ckpt"), ("EXIT_SIGNAL", "none"),
                                                                 ("TRAIN_ITERS", "100000")),
             during=(3, "sigterm-torchrun")),
    BadInput("ckpt-format-torch-under-canzona", "flags", env=(("CKPT_DIR", "{work}/ckpt"), ("CKPT_FORMAT", "torch"))),
    BadInput("save-is-a-file", "files", prepare="save-file"),
    BadInput("adamw-beta2-above-1", "range", ("--adam-beta2", "1.5")),
    BadInput("qk-clip-threshold-without-clip", "unread", ("--qk-clip-threshold", "50")),
    BadInput("early-compute-on-without-budget", "unread", ("--canzona-early-compute", "on",
                                                           "--canzona-early-compute-budget", "0")),
    BadInput("a-rank-stops-answering", "peer", ("--distributed-timeout-seconds-after-init", "5"),
             env=(("CKPT_DIR", "{work}/ckpt"), ("SAVE_INTERVAL", "2"), ("TRAIN_ITERS", "100000")),
             during=(3, "sigstop-rank1")),
    BadInput("every-step-over-the-skip-threshold", "skip", ("--grad-norm-skip-threshold", "0.01")),
    BadInput("normuon-resumed-as-adamuon", "resume", env=(("OPTIMIZER", "adaptive_muon"),),
             prepare="checkpoint-normuon"),
    BadInput("checkpoint-without-optimizer-state", "resume", prepare="checkpoint-no-optim"),
    BadInput("shard-cut-short", "resume", prepare="shard-cut"),
    BadInput("tracker-names-a-missing-iteration", "resume", prepare="tracker-missing"),
    BadInput("ckpt-step-without-such-checkpoint", "resume", ("--ckpt-step", "7"), prepare="checkpoint"),
    BadInput("bin-cut-short-while-running", "data", env=(("TRAIN_ITERS", "100000"),), prepare="bin-copy",
             during=(2, "cut-bin")),
)
"""The table ``--bad-input`` runs: careless inputs of each kind a user makes."""
OUTCOMES = ("one line", "saved", "traceback", "silent", "hang", "loss")
ERROR_LINE = re.compile(r"^\S+: error: ")
LONG_LINE = 300
"""Characters above which an error line counts as too long to read (a long command goes on a line of its own),
the case's directory counted as one."""
RANK_PREFIX = re.compile(r"^\[(?:default|rank)\d+\]:\s?")
"""What torch puts before every line a rank prints once its process group started (``[rank0]: ``), or
torchrun's ``--tee`` (``[default0]: ``)."""
SEEDS = {"checkpoint": (), "checkpoint-normuon": ("--optimizer", "adaptive_muon", "--adaptive-muon-moment2-method",
                                                 "normuon"), "checkpoint-no-optim": ("--no-save-optim",)}
"""The seed runs the resume cases start from, by :attr:`BadInput.prepare`, and their extra flags."""


def _prepare(case: BadInput, work: Path, seeds: dict[str, Path]) -> tuple[dict[str, str], list[str]]:
    """Set up what ``case`` damages; the environment and the extra flags it runs with."""
    demo = ROOT / "data" / "demo" / "demo_text_document"
    if case.prepare in ("cut-idx", "long-bin", "bin-copy"):
        copy = work / "data" / "copy_text_document"
        copy.parent.mkdir(parents=True)
        index, data = Path(f"{demo}.idx").read_bytes(), Path(f"{demo}.bin").read_bytes()
        Path(f"{copy}.idx").write_bytes(index[: len(index) - 40] if case.prepare == "cut-idx" else index)
        Path(f"{copy}.bin").write_bytes(data + bytes(128) if case.prepare == "long-bin" else data)
        return {"DATA_PATH": str(copy), "DATA_CACHE": str(work / "data" / "cache")}, []
    if case.prepare == "hf-dir":
        hf = work / "Qwen3-0.6B"
        hf.mkdir(parents=True)
        (hf / "config.json").write_text("{}")
        (hf / "model.safetensors").write_bytes(b"")
        return {}, ["--load", str(hf)]
    if case.prepare == "save-file":
        (work / "ckpt").write_text("a file where the checkpoints would go\n")
        return {"CKPT_DIR": str(work / "ckpt")}, []
    if case.prepare in (*SEEDS, "sidecar", "shard-cut", "tracker-missing"):
        ckpt = work / "ckpt"
        shutil.copytree(seeds[case.prepare if case.prepare in SEEDS else "checkpoint"], ckpt)
        latest = ckpt / f"iter_{_tracked_iteration(ckpt):07d}"
        if case.prepare == "sidecar":
            listing = next((latest / "checksums").glob("__0_*.sha256"))
            listing.write_text("0" * 64 + "  " + listing.read_text().split()[1] + "\n")
        if case.prepare == "shard-cut":
            shard = next(latest.glob("__1_*.distcp"))
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        if case.prepare == "tracker-missing":
            (ckpt / TRACKER).write_text("9")
        return {"CKPT_DIR": str(ckpt)}, []
    if case.prepare in ("calibration-cut", "calibration-one-method"):
        shipped = ROOT / "tools" / "calibrations" / "h100-muon-bf16.json"
        calibration = work / "calibration.json"
        text = shipped.read_text()
        if case.prepare == "calibration-one-method":  # what tools/bench_optim.py --calibrate writes for one method
            text = json.dumps({k: v for k, v in json.loads(text).items() if k != "muon_methods"})
        calibration.write_text(text[: len(text) // 2] if case.prepare == "calibration-cut" else text)
        return {}, ["--canzona-calibration", str(calibration)]
    return {}, []


def _seed_checkpoint(root: Path, name: str, timeout: float) -> Path:
    """A short run (2 iterations, saved at 1 and 2) the resume cases start from: Muon, or what
    :data:`SEEDS` adds for ``name``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NPROC_PER_NODE": "2", "TP": "1",
           "TRAIN_ITERS": "2", "SAVE_INTERVAL": "1", "WARMUP_ITERS": "1", "EVAL_ITERS": "0", "EVAL_INTERVAL": "100",
           "LOG_DIR": str(root / name), "CKPT_DIR": str(root / name / "ckpt"), "MASTER_PORT": str(free_port())}
    done = subprocess.run(["bash", str(RECIPE), *SEEDS[name]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the seed run {name} failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return root / name / "ckpt"


def rank_traceback(output: str) -> bool:
    """Whether a rank printed a traceback: one with a frame outside torchrun's own code (its
    failure report, which stays, has its own traceback of ``torch/distributed`` and ``runpy``),
    with or without the ``[rankN]: `` torch puts before a rank's lines once its group started."""
    lines = [RANK_PREFIX.sub("", line) for line in output.splitlines()]
    for i, line in enumerate(lines):
        if line.strip() == "Traceback (most recent call last):":
            frames = [f for f in lines[i + 1:i + 200] if f.lstrip().startswith('File "')]
            if any("torch/distributed/" not in f and "<frozen " not in f for f in frames[:50]):
                return True
    return False


class _Watched:
    """A launch whose output is read as it comes, to act once it logs iteration N (``during``)."""

    def __init__(self, command: list[str], env: dict[str, str], during: tuple[int, str] | None,
                 data: str | None) -> None:
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.during, self.data, self.lines, self.acted = during, data, [], False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            logged = ITERATION.search(line)
            if self.during and not self.acted and logged and int(logged[1]) >= self.during[0]:
                self.acted = True
                self._act(self.during[1])

    def _act(self, what: str) -> None:
        if what == "sigterm-torchrun":
            os.kill(self.process.pid, signal.SIGTERM)  # the recipe execs torchrun
        elif what == "sigstop-rank1":
            os.kill(ranks_of(self.process.pid)["1"], signal.SIGSTOP)
        elif what == "cut-bin":
            os.truncate(f"{self.data}.bin", 4096)

    def finish(self, timeout: float) -> tuple[int | None, str]:
        try:
            code: int | None = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        end_session(self.process)
        self._reader.join(timeout=10)
        return code, "".join(self.lines)


def run_bad_input(case: BadInput, root: Path, seeds: dict[str, Path], timeout: float) -> dict:
    """One case: its outcome (:data:`OUTCOMES`), how many times its error line was printed,
    the line, and the checkpoint it resumed from still whole (no loss)."""
    work = root / case.name
    work.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NPROC_PER_NODE": "2", "TP": "1",
           "TRAIN_ITERS": "4", "WARMUP_ITERS": "1", "EVAL_ITERS": "0", "EVAL_INTERVAL": "100", "LOG_INTERVAL": "2",
           "LOG_DIR": str(work), "CKPT_DIR": "none", "MASTER_PORT": str(free_port()),
           **{key: value.replace("{work}", str(work)) for key, value in case.env}}
    if case.during:
        env["LOG_INTERVAL"] = "1"
    prepared, flags = _prepare(case, work, seeds)
    env.update(prepared)
    extra = [*case.flags, *flags]
    resumed = case.prepare in (*SEEDS, "sidecar")
    tracked = (Path(env["CKPT_DIR"]) / TRACKER).read_text() if resumed else None
    command = ([sys.executable, str(ROOT / "tools" / case.command[0]), *case.command[1:]] if case.command
               else ["bash", str(RECIPE), *extra])
    code, output = _Watched(command, env, case.during, env.get("DATA_PATH")).finish(timeout)
    (work / "output.log").write_text(output)
    errors = [line for line in (RANK_PREFIX.sub("", line) for line in output.splitlines()) if ERROR_LINE.match(line)]
    lost = False
    if tracked is not None:
        ckpt = Path(env["CKPT_DIR"])
        lost = (ckpt / TRACKER).read_text() != tracked or (
            case.prepare in SEEDS and _checkpoint_problem(ckpt / f"iter_{int(tracked):07d}") is not None)
    if code is None:
        outcome = "hang"
    elif case.expect == "saved":
        saved = _tracked_iteration(Path(env["CKPT_DIR"]))
        outcome = ("saved" if saved >= case.during[0] and "[canzona] SIGTERM after iteration" in output and not errors
                   and not rank_traceback(output) and "exitcode" not in output else "loss")
    elif lost:
        outcome = "loss"
    elif rank_traceback(output):
        outcome = "traceback"
    elif code == 0 or not errors:
        outcome = "silent"
    else:
        outcome = "one line"
    line = errors[0] if errors else None
    # Its length as a user reads it with a path of their own: the case's directory counts as one character.
    chars = len(line.replace(str(work), "…").replace(f"{ROOT}/", "")) if line else 0
    return {"name": case.name, "kind": case.kind, "outcome": outcome, "expected": case.expect, "exit": code,
            "printed": len(errors), "chars": chars, "line": line}


def bad_input(args: argparse.Namespace) -> int:
    """``--bad-input``: every case of :data:`BAD_INPUTS` (or ``--bad-cases``), a table of outcomes."""
    names = [c.strip() for c in args.bad_cases.split(",")] if args.bad_cases else [c.name for c in BAD_INPUTS]
    cases = [c for c in BAD_INPUTS if c.name in names]
    root = Path(args.dir or tempfile.mkdtemp(prefix="chaos_bad_input_"))
    started = time.perf_counter()
    rows = []
    demo = ROOT / "data" / "demo"
    if not (demo / "demo_text_document.idx").is_file():  # what the recipe trains on (it would make it too)
        subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_demo_data.py"), "--output-dir", str(demo)],
                       cwd=ROOT, check=True, capture_output=True)
    try:
        wanted = {"checkpoint" if c.prepare in ("sidecar", "shard-cut", "tracker-missing")
                  else c.prepare for c in cases} & set(SEEDS)
        seeds = {name: _seed_checkpoint(root / "seeds", name, args.launch_timeout) for name in sorted(wanted)}
        for case in cases:
            row = run_bad_input(case, root, seeds, args.launch_timeout)
            rows.append(row)
            print(f"[chaos] {case.name}: {row['outcome']}, printed {row['printed']}x, {row['chars']} chars", flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"| input | kind | outcome | exit | printed | the line |\n|---|---|---|---|---|---|")
    for row in rows:
        line = (row["line"] or "").replace("|", "\\|")
        print(f"| {row['name']} | {row['kind']} | {row['outcome']} | {row['exit']} | {row['printed']} | {line} |")
    counts = {outcome: sum(row["outcome"] == outcome for row in rows) for outcome in OUTCOMES}
    repeated = sum(row["printed"] > 1 for row in rows)
    long_lines = sum(row["chars"] > LONG_LINE for row in rows)
    handled = sum(row["outcome"] == row["expected"] for row in rows)
    print(f"{len(rows)} inputs: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES)
          + f"; {handled} as expected; {repeated} printed more than once; {long_lines} lines over {LONG_LINE} "
          f"characters; {(time.perf_counter() - started) / 60:.1f} min")
    report = {"git_revision": git_revision(), "machine": machine(), "counts": counts, "repeated": repeated,
              "long_lines": long_lines, "cases": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(rows, root))
    return 0 if handled == len(rows) and not repeated and not long_lines else 1


def markdown_table(rows: list[dict], root: Path) -> str:
    """The outcomes as docs/bad_input.md's table: the runs' directory shortened to ``…``."""
    lines = ["| input | kind | outcome | printed | chars | the line (paths shortened) |", "|---|---|---|---|---|---|"]
    for row in rows:
        line = (row["line"] or "").replace(str(root), "…").replace(str(ROOT) + "/", "").replace("|", "\\|")
        lines.append(f"| {row['name']} | {row['kind']} | {row['outcome']} | {row['printed']}× | {row['chars']} | {line} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
