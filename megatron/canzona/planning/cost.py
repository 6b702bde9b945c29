"""Per-matrix cost of one optimizer update: FLOP formulas, or measured seconds.

Formulas follow the operation counts of each algorithm (m×n matrix, a = min, b = max):

* Muon, k Newton-Schulz steps: each step forms A = X Xᵀ (2a²b), B = cA + dA² (2a³) and
  B X (2a²b), so k·(4a²b + 2a³). Gram Newton-Schulz (:func:`ns_flops`) iterates on a×a
  matrices alone: per run of L steps between restarts, the Gram matrix (2a²b), L squares,
  L − 1 updates of the accumulated polynomial and 2(L − 1) of the Gram matrix (2a³ each),
  and the accumulated polynomial applied to the input (2a²b); over s runs
  4s·a²b + 2a³(4k − 3s).
* Shampoo: statistics G Gᵀ and Gᵀ G (2m²n + 2mn²) and preconditioning L^-¼ G R^-¼
  (2m²n + 2mn²) every step; eigendecompositions (≈ EIGH_FLOPS_PER_CUBE · d³ per side)
  every ``precond_every`` steps.
* SOAP: rotation into the eigenbasis and back (4m²n + 4mn²) and statistics (2m²n + 2mn²)
  every step; one power-iteration step plus QR (≈ QR_FLOPS_PER_CUBE · d³ per side) every
  ``precond_every`` steps.
* Sides larger than ``max_precond_dim`` fall back to a diagonal statistic (O(mn)).

A :class:`Calibration` of measured seconds per shape replaces the formulas: shapes it
lists cost their measured time, other shapes cost their FLOPs times the median
seconds-per-FLOP of the listed ones, so every cost is in seconds.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

from .specs import ParamSpec

EIGH_FLOPS_PER_CUBE = 9.0
"""Symmetric eigendecomposition with eigenvectors: tridiagonalisation plus QR iterations."""
QR_FLOPS_PER_CUBE = 10.0 / 3.0
"""One power-iteration product (2d³) plus a Householder QR (≈ 4/3 d³)."""
ADAMW_FLOPS_PER_ELEMENT = 12.0
"""Moments, bias correction, division, weight decay and update, per element."""

OPTIMIZERS: tuple[str, ...] = ("muon", "shampoo", "soap", "adaptive_muon")
"""The matrix optimizers, by name: the one list the runtime, the flags and the tools read
(``megatron.canzona.optim.MATRIX_OPTIMIZERS`` maps each to its math)."""
NS_OPTIMIZERS: tuple[str, ...] = ("muon", "adaptive_muon")
"""The optimizers whose cost is Newton-Schulz (``--muon-ns-method`` and its calibration apply)."""
MOMENT2_FLOPS_PER_ELEMENT = 8.0
"""AdaMuon's and NorMuon's second moment: square, EMA, root (or mean and inverse root) and
the normalisation, per element (NorMuon's norm matching included)."""
COST_KINDS: tuple[str, ...] = (*OPTIMIZERS, "numel")


NS_METHODS: tuple[str, ...] = ("standard", "gram", "auto")
"""Newton-Schulz methods (``--muon-ns-method``): ``standard`` iterates on the matrix, ``gram``
on its Gram matrix, ``auto`` takes gram where :func:`ns_method_for` finds it cheaper."""
GRAM_RESTART_EVERY: dict[str, int | None] = {"float64": None, "float32": 5, "bfloat16": 2, "float16": 2}
"""Steps between restarts of Gram Newton-Schulz (the iterate formed and its Gram matrix
taken again), by the dtype of the iteration; ``None``: never. Gram Newton-Schulz evaluates
a run's composed polynomial on its iterated Gram matrix, not on the iterate, so the
rounding of that matrix is amplified by the slope of the composed polynomial (which grows
about 4x a step once the singular values oscillate around 1). Measured with
tools/ns_band.py on random, ill-conditioned and rank-deficient inputs (docs/newton_schulz.md):
in bf16 runs of 2 steps keep the singular values in the band as closely as standard
Newton-Schulz does, runs of 3 leave it by up to 10³ (Polar Express) and of 5 by up to 10¹³;
in fp32 a run of 5 steps holds, one of 8 leaves the band by up to 8."""
AUTO_GRAM_FLOP_RATIO = 0.8
"""``auto`` takes gram where its FLOPs are at most this fraction of standard's: the a×a
products and the restarts run at a lower rate than the large products, so a gram that
saves less than 20% of the FLOPs is not reliably faster."""
AUTO_GRAM_MIN_SIDE = 256
"""``auto`` keeps standard for a matrix whose short side is below this: there the time
goes to launching kernels and elementwise passes, and gram runs more of both (tools/
bench_optim.py on CPU: gram 1.6x slower on a 64 × 176 matrix whose FLOPs it cuts by 30%)."""


def gram_runs(ns_steps: int, dtype: str, restart_every: int | None = None) -> list[int]:
    """The steps of each run of Gram Newton-Schulz between restarts: every ``restart_every``
    steps, by default the dtype's :data:`GRAM_RESTART_EVERY`."""
    every = restart_every or GRAM_RESTART_EVERY[dtype] or ns_steps
    return [min(every, ns_steps - start) for start in range(0, ns_steps, every)]


MeasuredMethods = tuple[tuple[int, int, str], ...]
"""``(short side, long side, method)`` of shapes whose faster Newton-Schulz method was measured
(:func:`megatron.canzona.planning.sim.cluster.measured_ns_methods` reads them from a calibration)."""


def ns_flops(m: int, n: int, ns_steps: int = 5, method: str = "standard", dtype: str = "bfloat16",
             measured: MeasuredMethods = ()) -> float:
    """FLOPs of ``ns_steps`` Newton-Schulz iterations on an m×n matrix by ``method``
    (``auto`` counts the method :func:`ns_method_for` picks), iterated in ``dtype``."""
    a, b = min(m, n), max(m, n)
    method = ns_method_for(m, n, ns_steps, method, dtype, measured)
    if method == "standard":
        return float(ns_steps * (4 * a * a * b + 2 * a**3))
    runs = len(gram_runs(ns_steps, dtype))
    return float(4 * runs * a * a * b + 2 * a**3 * (4 * ns_steps - 3 * runs))


def sharded_ns_flops(split: int, other: int, shards: int, ns_steps: int = 5, method: str = "standard",
                     dtype: str = "bfloat16") -> float:
    """FLOPs on each of ``shards`` ranks orthogonalising one matrix together, each holding an equal
    slice of its side of ``split`` elements (its other side ``other``): Megatron's ``--muon-tp-mode
    distributed``. The Gram matrix is taken on the unsplit side, ``other × other``, from every
    rank's slice and summed over the ranks (:func:`gram_reductions` all-reduces); the products
    with the split side divide among the ranks, those on the ``other``-square run on every one.
    With ``shards`` 1 and the split side the long one this is :func:`ns_flops`; with the short side
    split the Gram matrix is the large square (emerging-optimizers warns of it)."""
    a, b = other, split / shards
    if method == "standard":
        return float(ns_steps * (4 * a * a * b + 2 * a**3))
    if method != "gram":
        raise ValueError(f"a sharded Newton-Schulz runs 'standard' or 'gram', got {method!r}")
    runs = len(gram_runs(ns_steps, dtype))
    return float(4 * runs * a * a * b + 2 * a**3 * (4 * ns_steps - 3 * runs))


def tp_sides(spec: ParamSpec, m: int, n: int) -> tuple[int, int]:
    """``(split, other)``: the TP-split side of ``spec``'s m×n matrix and its other side."""
    return (m, n) if spec.tp_dim == 0 else (n, m)


def gram_reductions(ns_steps: int = 5, method: str = "standard", dtype: str = "bfloat16") -> int:
    """All-reduces of the Gram matrix in one sharded Newton-Schulz (:func:`sharded_ns_flops`):
    one a step for ``standard``, one a run between restarts for ``gram``."""
    return ns_steps if method == "standard" else len(gram_runs(ns_steps, dtype))


def ns_method_for(m: int, n: int, ns_steps: int, method: str, dtype: str, measured: MeasuredMethods = ()) -> str:
    """``standard`` or ``gram``: ``method`` itself, or for ``auto`` the method ``measured`` found
    faster for the shape (a calibration on the run's machine), else gram where its FLOPs are
    at most :data:`AUTO_GRAM_FLOP_RATIO` of standard's (aspect ratio above about 2.2 in fp32,
    3.5 in bf16 with its restarts, for 5 steps) on a matrix whose short side is at least
    :data:`AUTO_GRAM_MIN_SIDE`."""
    if method not in NS_METHODS:
        raise ValueError(f"unknown Newton-Schulz method {method!r}; choose one of {NS_METHODS}")
    if dtype not in GRAM_RESTART_EVERY:
        raise ValueError(f"unknown Newton-Schulz dtype {dtype!r}; choose one of {tuple(GRAM_RESTART_EVERY)}")
    if method != "auto":
        return method
    shape = (min(m, n), max(m, n))
    for short, long, choice in measured:
        if (short, long) == shape:
            return choice
    if min(m, n) < AUTO_GRAM_MIN_SIDE:
        return "standard"
    gram = ns_flops(m, n, ns_steps, "gram", dtype)
    return "gram" if gram <= AUTO_GRAM_FLOP_RATIO * ns_flops(m, n, ns_steps, "standard", dtype) else "standard"


def muon_flops(m: int, n: int, ns_steps: int = 5, method: str = "standard", dtype: str = "bfloat16",
               measured: MeasuredMethods = ()) -> float:
    """FLOPs of one Muon update of an m×n matrix: its Newton-Schulz iterations."""
    return ns_flops(m, n, ns_steps, method, dtype, measured)


def _side_flops(d: int, other: int, *, per_step: int, refresh: float, max_dim: int) -> float:
    """Cost of one preconditioner side of dimension ``d`` (the other side is ``other``)."""
    if d > max_dim:
        return float(per_step // 2 * d * other)  # diagonal statistic and scaling: O(d·other)
    return float(per_step * d * d * other) + refresh * d**3


def shampoo_flops(
    m: int, n: int, *, precond_every: int = 10, max_precond_dim: int = 10000
) -> float:
    """FLOPs of one Shampoo step, eigendecompositions amortised over ``precond_every`` steps."""
    refresh = EIGH_FLOPS_PER_CUBE / precond_every
    # Per side: statistic (2d²·other) + one side of L^-¼ G R^-¼ (2d²·other).
    left = _side_flops(m, n, per_step=4, refresh=refresh, max_dim=max_precond_dim)
    right = _side_flops(n, m, per_step=4, refresh=refresh, max_dim=max_precond_dim)
    return left + right


def soap_flops(m: int, n: int, *, precond_every: int = 10, max_precond_dim: int = 10000) -> float:
    """FLOPs of one SOAP step, eigenbasis refresh amortised over ``precond_every`` steps."""
    refresh = QR_FLOPS_PER_CUBE / precond_every
    # Per side: rotate in and out (4d²·other) + statistic (2d²·other).
    left = _side_flops(m, n, per_step=6, refresh=refresh, max_dim=max_precond_dim)
    right = _side_flops(n, m, per_step=6, refresh=refresh, max_dim=max_precond_dim)
    return left + right


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Measured seconds per update for one optimizer, keyed by matrix shape."""

    optimizer: str
    """Cost kind the timings were measured for (``muon``, ``shampoo`` or ``soap``)."""
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    """Seconds per single-matrix update, by (m, n)."""
    ns_method: str | None = None
    """Newton-Schulz method Muon's timings were measured with (None: not recorded)."""

    def __post_init__(self) -> None:
        if self.ns_method is not None and self.ns_method not in NS_METHODS:
            raise ValueError(f"calibration ns_method must be one of {NS_METHODS}, got {self.ns_method!r}")
        if self.optimizer not in COST_KINDS:
            raise ValueError(f"calibration optimizer must be one of {COST_KINDS}, got {self.optimizer!r}")
        if not self.seconds:
            raise ValueError("a calibration needs at least one measured shape")
        if any(t <= 0 for t in self.seconds.values()):
            raise ValueError("calibrated timings must be positive seconds")

    def to_json(self) -> str:
        rows = [{"m": m, "n": n, "seconds": t} for (m, n), t in sorted(self.seconds.items())]
        method = {} if self.ns_method is None else {"ns_method": self.ns_method}
        return json.dumps({"optimizer": self.optimizer, **method, "timings": rows})

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        data = json.loads(text)
        return cls(
            optimizer=data["optimizer"],
            seconds={(r["m"], r["n"]): float(r["seconds"]) for r in data["timings"]},
            ns_method=data.get("ns_method"),
        )


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Cost of one optimizer update per matrix, from formulas or a calibration."""

    kind: str = "muon"
    """``muon``, ``shampoo``, ``soap``, ``adaptive_muon`` (FLOP formulas) or ``numel`` (element count)."""
    ns_steps: int = 5
    """Newton-Schulz iterations per Muon update."""
    ns_method: str = "standard"
    """Newton-Schulz method of Muon's updates (:data:`NS_METHODS`)."""
    ns_dtype: str = "bfloat16"
    """Dtype Muon's Newton-Schulz iterates in (gram's restarts depend on it)."""
    ns_measured: MeasuredMethods = ()
    """Shapes whose faster method was measured: ``auto`` takes it there (:func:`ns_method_for`)."""
    precond_every: int = 10
    """Steps between Shampoo inverse-root / SOAP eigenbasis refreshes."""
    max_precond_dim: int = 10000
    """Sides larger than this use a diagonal statistic (Shampoo and SOAP)."""
    calibration: Calibration | None = None
    """Measured seconds that replace the formulas where available."""

    def __post_init__(self) -> None:
        if self.kind not in COST_KINDS:
            raise ValueError(f"cost kind must be one of {COST_KINDS}, got {self.kind!r}")
        if self.ns_steps < 1 or self.precond_every < 1 or self.max_precond_dim < 1:
            raise ValueError("ns_steps, precond_every and max_precond_dim must be >= 1")
        ns_method_for(1, 1, self.ns_steps, self.ns_method, self.ns_dtype)  # names checked
        if self.calibration is not None and self.calibration.optimizer != self.kind:
            raise ValueError(
                f"calibration was measured for {self.calibration.optimizer!r} but the cost "
                f"model is {self.kind!r}; pass a calibration of the same optimizer"
            )
        measured = None if self.calibration is None else self.calibration.ns_method
        if self.kind in NS_OPTIMIZERS and measured is not None and measured != self.ns_method:
            raise ValueError(
                f"the calibration's Muon timings were measured with --muon-ns-method {measured}, this cost model "
                f"uses {self.ns_method}: project with --muon-ns-method {measured}, or measure {self.ns_method} with "
                f"tools/bench_optim.py --muon-ns-method {self.ns_method} --calibrate FILE"
            )

    @property
    def unit(self) -> str:
        if self.calibration is not None:
            return "s"
        return "elements" if self.kind == "numel" else "FLOP"

    def flops(self, m: int, n: int) -> float:
        """Formula cost of one m×n matrix update (elements for ``numel``)."""
        if self.kind in NS_OPTIMIZERS:
            extra = MOMENT2_FLOPS_PER_ELEMENT * m * n if self.kind == "adaptive_muon" else 0.0
            return muon_flops(m, n, self.ns_steps, self.ns_method, self.ns_dtype, self.ns_measured) + extra
        if self.kind == "shampoo":
            return shampoo_flops(m, n, precond_every=self.precond_every, max_precond_dim=self.max_precond_dim)
        if self.kind == "soap":
            return soap_flops(m, n, precond_every=self.precond_every, max_precond_dim=self.max_precond_dim)
        return float(m * n)

    def matrix_cost(self, m: int, n: int) -> float:
        """Cost of one m×n update: measured seconds if calibrated, else the formula."""
        if self.calibration is None:
            return self.flops(m, n)
        measured = self.calibration.seconds.get((m, n))
        if measured is not None:
            return measured
        return self.flops(m, n) * self._seconds_per_flop()

    def _seconds_per_flop(self) -> float:
        assert self.calibration is not None
        ratios = [t / self.flops(m, n) for (m, n), t in self.calibration.seconds.items()]
        return statistics.median(ratios)

    def cost(self, spec: ParamSpec) -> float:
        """Cost of one update of ``spec``: the sum over the matrices it is split into."""
        if spec.family == "elementwise":
            flops = ADAMW_FLOPS_PER_ELEMENT * spec.global_numel
            return flops * self._seconds_per_flop() if self.calibration else flops
        return sum(self.matrix_cost(m, n) for m, n in spec.matrices)

    def shared_cost(self, spec: ParamSpec) -> float:
        """Cost on each TP rank of ``spec``'s update computed by its TP ranks together, each on its
        shard, the Gram matrices summed among them (:func:`sharded_ns_flops`, by the method this
        model takes for the whole matrix); a calibration scales each matrix's FLOPs by its shape's
        measured seconds per FLOP. Newton-Schulz optimizers, TP-sharded parameters."""
        if self.kind not in NS_OPTIMIZERS or spec.tp_dim is None:
            raise ValueError(f"{spec.name}: only a TP-sharded matrix of a Newton-Schulz optimizer is computed by its "
                             f"TP ranks together (this: {self.kind}, TP dim {spec.tp_dim})")
        total = 0.0
        for m, n in spec.matrices:
            split, other = tp_sides(spec, m, n)
            method = ns_method_for(m, n, self.ns_steps, self.ns_method, self.ns_dtype, self.ns_measured)
            flops = sharded_ns_flops(split, other, spec.tp_size, self.ns_steps, method, self.ns_dtype)
            if self.kind == "adaptive_muon":
                flops += MOMENT2_FLOPS_PER_ELEMENT * m * n / spec.tp_size
            total += flops if self.calibration is None else flops * self.matrix_cost(m, n) / self.flops(m, n)
        return total

    def shared_reductions(self, spec: ParamSpec) -> list[tuple[int, int]]:
        """``(all-reduces, elements of each)`` of the Gram matrices of ``spec``'s matrices when its
        TP ranks compute it together (:meth:`shared_cost`)."""
        out = []
        for m, n in spec.matrices:
            _, other = tp_sides(spec, m, n)
            method = ns_method_for(m, n, self.ns_steps, self.ns_method, self.ns_dtype, self.ns_measured)
            out.append((gram_reductions(self.ns_steps, method, self.ns_dtype), other * other))
        return out

    def part_costs(self, spec: ParamSpec) -> list[float]:
        """Cost of each part of ``spec`` hosted apart (:attr:`ParamSpec.parts`); they add up to
        :meth:`cost`."""
        if len(spec.parts) == 1:
            return [self.cost(spec)]
        return [sum(self.matrix_cost(m, n) for m, n in spec.part_matrices(k)) for k in range(len(spec.parts))]
