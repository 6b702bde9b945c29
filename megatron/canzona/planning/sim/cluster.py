"""Cluster descriptions and calibration files, read with one-line errors that name the field.

The schema is in the package docstring (:mod:`megatron.canzona.planning.sim`). Files are
TOML (``.toml``) or JSON (anything else); :meth:`ClusterSpec.from_dict` takes the same
mapping from code.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..cost import NS_METHODS, OPTIMIZERS, Calibration

OPTIMIZER_DTYPES: tuple[str, ...] = ("bf16", "fp32")


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """One accelerator (or one CPU rank): its matmul and memory throughput."""

    bf16_tflops: float
    """Dense bf16 matmul peak, TFLOP/s."""
    fp32_tflops: float
    """fp32 matmul peak, TFLOP/s."""
    memory_gb_per_s: float
    """Memory bandwidth, GB/s."""
    matmul_efficiency: float = 0.6
    """Fraction of the matmul peak the optimizer's matmuls reach."""
    memory_efficiency: float = 0.8
    """Fraction of the memory bandwidth elementwise kernels reach."""
    optimizer_dtype: str = "bf16"
    """Dtype of the optimizer's matmuls (Newton-Schulz, preconditioners): ``bf16`` or ``fp32``."""

    @property
    def optimizer_flops_per_s(self) -> float:
        """Matmul FLOP/s the optimizer's updates run at."""
        peak = self.bf16_tflops if self.optimizer_dtype == "bf16" else self.fp32_tflops
        return peak * 1e12 * self.matmul_efficiency

    @property
    def ns_dtype(self) -> str:
        """The optimizer's matmul dtype as Muon's ``ns_dtype`` names it."""
        return "bfloat16" if self.optimizer_dtype == "bf16" else "float32"

    @property
    def memory_bytes_per_s(self) -> float:
        """Bytes/s elementwise kernels move."""
        return self.memory_gb_per_s * 1e9 * self.memory_efficiency


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One kind of link: per-rank bandwidth in each direction and per-message latency."""

    bandwidth_gb_per_s: float
    """GB/s one rank sends (and receives) at once over this link."""
    latency_us: float
    """Microseconds per message or ring step (α of the α-β model)."""

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gb_per_s * 1e9

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True, kw_only=True)
class CollectiveSpec:
    """How close the collectives' algorithms come to the link bandwidth."""

    ring_efficiency: float = 1.0
    """Reduce-scatter / all-gather bus bandwidth over link bandwidth."""
    alltoall_efficiency: float = 1.0
    """All-to-all bandwidth over link bandwidth."""


BACKENDS = ("nccl", "gloo")
"""Collective backends a cluster file may name."""


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Nodes of identical ranks, a fast link inside a node and a slower one between nodes."""

    name: str
    """Preset or file name, for reports."""
    gpus_per_node: int
    """Ranks per node."""
    gpu: GPUSpec
    """Each rank's compute and memory."""
    intra_node: LinkSpec
    """Link between ranks of one node (NVLink)."""
    inter_node: LinkSpec | None = None
    """Link between nodes, per rank (InfiniBand); ``None`` for a single-node cluster."""
    collectives: CollectiveSpec = CollectiveSpec()
    """Algorithm efficiencies."""
    mfu: float = 0.4
    """Model FLOPs utilization of forward and backward (fraction of the bf16 peak)."""
    compute_slots: int | None = None
    """Ranks of a node that compute at once (``None``: all of them)."""
    backend: str = "nccl"
    """The collectives' backend: ``nccl`` (GPUs: Canzona's host-group gathers go in backward, as
    each bucket's reduce-scatter completes) or ``gloo`` (CPU: they go when backward ends)."""

    def contention(self, ranks: int) -> float:
        """Slow-down of compute when ``ranks`` ranks of a node share fewer compute slots."""
        slots = self.compute_slots or self.gpus_per_node
        return max(1.0, min(ranks, self.gpus_per_node) / slots)

    def link(self, spans_nodes: bool) -> LinkSpec:
        """The link a transfer uses; ValueError when it needs an inter-node link there is none of."""
        if not spans_nodes:
            return self.intra_node
        if self.inter_node is None:
            raise ValueError(
                f"cluster {self.name!r} has no [inter_node] link but the run spans more than its "
                f"gpus_per_node={self.gpus_per_node} ranks; add [inter_node] or use fewer ranks"
            )
        return self.inter_node

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "cluster") -> ClusterSpec:
        """Build from the schema's mapping; ValueError ``"<source>: <field> ..."`` on bad input."""
        reader = _Reader(source)
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: expected a table of cluster fields, got {type(data).__name__}")
        gpu = reader.table(data, "gpu")
        training = reader.table(data, "training", required=False)
        links = reader.table(data, "collectives", required=False)
        dtype = gpu.get("optimizer_dtype", "bf16")
        if dtype not in OPTIMIZER_DTYPES:
            raise ValueError(f"{source}: gpu.optimizer_dtype must be one of {OPTIMIZER_DTYPES}, got {dtype!r}")
        inter = data.get("inter_node")
        return cls(
            name=str(data.get("name", os.path.splitext(os.path.basename(source))[0])),
            gpus_per_node=reader.integer(data, "gpus_per_node"),
            gpu=GPUSpec(
                bf16_tflops=reader.number(gpu, "gpu.bf16_tflops"),
                fp32_tflops=reader.number(gpu, "gpu.fp32_tflops"),
                memory_gb_per_s=reader.number(gpu, "gpu.memory_gb_per_s"),
                matmul_efficiency=reader.fraction(gpu, "gpu.matmul_efficiency", 0.6),
                memory_efficiency=reader.fraction(gpu, "gpu.memory_efficiency", 0.8),
                optimizer_dtype=dtype,
            ),
            intra_node=reader.link(reader.table(data, "intra_node"), "intra_node"),
            inter_node=None if inter is None else reader.link(reader.table(data, "inter_node"), "inter_node"),
            collectives=CollectiveSpec(
                ring_efficiency=reader.fraction(links, "collectives.ring_efficiency", 1.0),
                alltoall_efficiency=reader.fraction(links, "collectives.alltoall_efficiency", 1.0),
            ),
            mfu=reader.fraction(training, "training.mfu", 0.4),
            compute_slots=reader.integer(data, "compute_slots") if "compute_slots" in data else None,
            backend=reader.choice(data, "backend", BACKENDS, "nccl"),
        )

    def to_dict(self) -> dict[str, Any]:
        """The schema's mapping (``from_dict(to_dict())`` gives an equal spec)."""
        out: dict[str, Any] = {
            "name": self.name, "gpus_per_node": self.gpus_per_node, "gpu": vars(self.gpu).copy(),
            "training": {"mfu": self.mfu}, "intra_node": vars(self.intra_node).copy(),
            "collectives": vars(self.collectives).copy(),
        }
        if self.inter_node is not None:
            out["inter_node"] = vars(self.inter_node).copy()
        if self.compute_slots is not None:
            out["compute_slots"] = self.compute_slots
        if self.backend != "nccl":
            out["backend"] = self.backend
        return out


class _Reader:
    """Field checks that raise one-line ValueErrors prefixed with the file name."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, what: str, value: Any) -> ValueError:
        return ValueError(f"{self.source}: {field} must be {what}, got {value!r}")

    def table(self, data: Mapping[str, Any], key: str, required: bool = True) -> Mapping[str, Any]:
        if key not in data:
            if required:
                raise ValueError(f"{self.source}: missing [{key}] table (see the schema in megatron.canzona.planning.sim)")
            return {}
        if not isinstance(data[key], Mapping):
            raise self.fail(f"[{key}]", "a table", data[key])
        return data[key]

    def number(self, data: Mapping[str, Any], field: str, default: float | None = None) -> float:
        key = field.rsplit(".", 1)[-1]
        if key not in data:
            if default is None:
                raise ValueError(f"{self.source}: missing {field} (a positive number)")
            return default
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.fail(field, "a positive number", value)
        return float(value)

    def fraction(self, data: Mapping[str, Any], field: str, default: float) -> float:
        value = self.number(data, field, default)
        if value > 1:
            raise self.fail(field, "a fraction in (0, 1]", value)
        return value

    def integer(self, data: Mapping[str, Any], field: str) -> int:
        value = data.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(field, "a positive integer", value)
        return value

    def choice(self, data: Mapping[str, Any], field: str, choices: tuple[str, ...], default: str) -> str:
        value = data.get(field, default)
        if value not in choices:
            raise self.fail(field, f"one of {', '.join(choices)}", value)
        return value

    def link(self, data: Mapping[str, Any], name: str) -> LinkSpec:
        latency = data.get("latency_us")
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not math.isfinite(latency) or latency < 0:
            raise self.fail(f"{name}.latency_us", "a number >= 0", latency)
        return LinkSpec(bandwidth_gb_per_s=self.number(data, f"{name}.bandwidth_gb_per_s"), latency_us=float(latency))


def _read_mapping(path: str) -> Any:
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror}); pass an existing file") from None
    try:
        if path.endswith(".toml"):
            return tomllib.loads(raw.decode())
        return json.loads(raw)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        kind = "TOML" if path.endswith(".toml") else "JSON"
        raise ValueError(f"{name}: not valid {kind}: {str(exc).splitlines()[0]}") from None


PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clusters")
"""The cluster presets shipped with the package (``<name>.toml``)."""


def presets() -> list[str]:
    """Names of the shipped cluster presets."""
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".toml")) if os.path.isdir(PRESET_DIR) else []


def preset_path(name: str) -> str:
    return os.path.join(PRESET_DIR, f"{name}.toml")


def load_cluster(path: str) -> ClusterSpec:
    """Read a cluster file (TOML or JSON), or a preset by name (:func:`presets`)."""
    if not os.path.exists(path) and os.path.exists(preset_path(path)):
        path = preset_path(path)
    elif not os.path.exists(path) and os.sep not in path and not path.endswith((".toml", ".json")):
        raise ValueError(f"cluster {path!r} is neither a file nor a preset; choose one of {', '.join(presets())} "
                         "or pass a TOML/JSON file")
    return ClusterSpec.from_dict(_read_mapping(path), source=os.path.basename(path))


def load_calibration(path: str, optimizer: str | None = None, ns_method: str | None = None) -> Calibration:
    """Read a calibration (``tools/bench_optim.py --calibration-dir`` or ``--calibrate`` output) with
    errors naming the field: ``{"optimizer": "muon", "timings": [{"m": 4096, "n": 4096, "seconds":
    0.0123}, ...]}``. A ``--calibrate`` file holds every optimizer it measured under ``optimizers``:
    ``optimizer`` picks one (``None``: the top level, the first measured); and Muon's of each
    Newton-Schulz method it measured under ``muon_methods``: ``ns_method`` picks one there (where
    it has none, the optimizer's entry is returned, and the cost model names the mismatch)."""
    name = os.path.basename(path)
    data = _read_mapping(path)
    methods = data.get("muon_methods") if isinstance(data, Mapping) else None
    if ns_method is not None and optimizer in (None, "muon") and isinstance(methods, Mapping) and ns_method in methods:
        return calibration_from_dict(methods[ns_method], source=f"{name}: muon_methods.{ns_method}")
    if optimizer is None or data.get("optimizer") == optimizer:
        return calibration_from_dict(data, source=name)
    entries = data.get("optimizers")
    if not isinstance(entries, Mapping) or optimizer not in entries:
        have = sorted(entries) if isinstance(entries, Mapping) else [data.get("optimizer")]
        raise ValueError(f"{name}: optimizers has no {optimizer!r} calibration (it has {', '.join(map(str, have))}); "
                         f"measure it with tools/bench_optim.py --optimizer {optimizer} --calibrate FILE")
    return calibration_from_dict(entries[optimizer], source=f"{name}: optimizers.{optimizer}")


NS_CALIBRATION_METHODS = ("standard", "gram")
"""The Newton-Schulz methods a calibration times for ``--muon-ns-method auto``, each under ``muon_methods``."""
NS_CALIBRATION_DTYPES = ("bfloat16", "float32")
"""The values of a calibration's ``ns_dtype``: the dtype Newton-Schulz iterated in when it was timed."""


def read_ns_calibration(path: str) -> tuple[str, dict[str, Calibration]]:
    """A Newton-Schulz calibration (``tools/bench_optim.py --muon-ns-method standard gram
    --calibrate FILE``): its ``ns_dtype`` and each method's timings, every field checked;
    ``ValueError`` naming the file and the field otherwise."""
    data = _read_mapping(path)
    name = os.path.basename(path)
    if not isinstance(data, Mapping):
        raise ValueError(f"{name}: expected an object with 'ns_dtype' and 'muon_methods', got {type(data).__name__}")
    methods = data.get("muon_methods")
    if not isinstance(methods, Mapping) or not set(NS_CALIBRATION_METHODS) <= set(methods):
        found = f"got {sorted(methods) if isinstance(methods, Mapping) else methods!r}" if methods is not None \
            else "it has none (a calibration of one method?)"
        raise ValueError(f"{name}: muon_methods must hold the timings of {' and '.join(NS_CALIBRATION_METHODS)}; {found}")
    ns_dtype = data.get("ns_dtype")
    if ns_dtype not in NS_CALIBRATION_DTYPES:
        raise ValueError(f"{name}: ns_dtype must be one of {', '.join(NS_CALIBRATION_DTYPES)}, got {ns_dtype!r}")
    return ns_dtype, {method: calibration_from_dict(methods[method], source=f"{name}: muon_methods.{method}")
                      for method in NS_CALIBRATION_METHODS}


def measured_ns_methods(path: str, ns_dtype: str) -> tuple[tuple[int, int, str], ...]:
    """The faster Newton-Schulz method of every shape a calibration (:func:`read_ns_calibration`)
    timed both ways, as ``(short side, long side, method)``; none where it measured another dtype
    than ``ns_dtype``."""
    measured_dtype, methods = read_ns_calibration(path)
    if measured_dtype != ns_dtype:
        return ()
    shapes: dict[tuple[int, int], str] = {}
    for (m, n), standard in methods["standard"].seconds.items():
        gram = methods["gram"].seconds.get((m, n))
        if gram is not None:
            shapes[(min(m, n), max(m, n))] = "gram" if gram < standard else "standard"
    return tuple((a, b, method) for (a, b), method in sorted(shapes.items()))


def calibration_from_dict(data: Any, source: str = "calibration") -> Calibration:
    """A :class:`Calibration` from its JSON mapping, every field checked."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected an object with 'optimizer' and 'timings', got {type(data).__name__}")
    optimizer = data.get("optimizer")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"{source}: optimizer must be one of muon, shampoo, soap, got {optimizer!r}")
    timings = data.get("timings")
    if not isinstance(timings, list) or not timings:
        raise ValueError(f"{source}: timings must be a non-empty list of {{m, n, seconds}}, got {timings!r}")
    seconds: dict[tuple[int, int], float] = {}
    for i, row in enumerate(timings):
        if not isinstance(row, Mapping):
            raise ValueError(f"{source}: timings[{i}] must be an object with m, n and seconds, got {row!r}")
        for key in ("m", "n"):
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{source}: timings[{i}].{key} must be a positive integer, got {value!r}")
        value = row.get("seconds")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{source}: timings[{i}].seconds must be a positive number, got {value!r}")
        seconds[(row["m"], row["n"])] = float(value)
    method = data.get("ns_method")
    if method is not None and method not in NS_METHODS:
        raise ValueError(f"{source}: ns_method must be one of {', '.join(NS_METHODS)} (or absent), got {method!r}")
    return Calibration(optimizer=optimizer, seconds=seconds, ns_method=method if optimizer == "muon" else None)
