"""Hyperparameters of the matrix optimizers, one small frozen dataclass per optimizer.

Learning rate and weight decay are deliberately *not* here: schedulers change the
learning rate every step and weight decay is applied outside the update functions
(see :func:`megatron.canzona.optim.common.apply_update`), so these configs describe
only the math that turns a gradient into an update direction.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron.canzona.optim.newton_schulz import NS_COEFFICIENTS
from megatron.canzona.planning.cost import NS_METHODS

ComputeDtype = Literal["bfloat16", "float32", "float64"]
RootDtype = Literal["float32", "float64"]
MuonScaleMode = Literal["moonlight", "spectral", "shape_scaling", "unit_rms_norm", "none"]
NSMethod = Literal[NS_METHODS]  # type: ignore[valid-type]  (the cost model's one list)

MUON_SCALE_MODES: tuple[str, ...] = typing.get_args(MuonScaleMode)

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def resolve_dtype(name: str) -> torch.dtype:
    """Map a config dtype name ("bfloat16", "float32", "float64") to a ``torch.dtype``."""
    return _DTYPES[name]


class FieldError(ValueError):
    """A config field out of its range: which class, field (and element of a pair), the value,
    and a valid one, so that an entry point can name its own flag for the field."""

    def __init__(self, config_class: type, name: str, value: Any, expected: str, example: Any,
                 index: int | None = None) -> None:
        self.config_class, self.name, self.index, self.value = config_class, name, index, value
        self.expected, self.example = expected, example
        field = f"{name}[{index}]" if index is not None else name
        super().__init__(f"{config_class.__name__}.{field}={value!r} {expected}; pick e.g. {example!r}.")


def _check_beta(config: Any, name: str, value: float, default: float, index: int | None = None) -> None:
    if not 0.0 <= value < 1.0:  # NaN too
        raise FieldError(type(config), name, value, "is outside [0, 1)", default, index)


def check_fields(config: Any) -> None:
    """Check every field of a config dataclass by its type and name, raising a
    :class:`FieldError` naming the field and a valid value: a ``Literal`` is one of its values;
    an ``int`` (step counts, frequencies, sizes) is >= 1; a ``float`` is a decay rate in [0, 1)
    when it is ``momentum`` or named ``*beta*``, else (epsilons, scales) > 0; a float pair
    ``betas`` holds two decay rates."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        name, value, kind = field.name, getattr(config, field.name), hints[field.name]
        if typing.get_origin(kind) is Literal:
            if value not in typing.get_args(kind):
                raise FieldError(type(config), name, value, f"is not one of {typing.get_args(kind)}", field.default)
        elif kind is int and value < 1:
            raise FieldError(type(config), name, value, "must be >= 1", field.default)
        elif kind is float and (name == "momentum" or "beta" in name):
            _check_beta(config, name, value, field.default)
        elif kind is float and not value > 0:
            raise FieldError(type(config), name, value, "must be > 0", field.default)
        elif kind == tuple[float, float]:
            if len(value) != 2:
                raise FieldError(type(config), name, value, "must be a pair (beta1, beta2)", field.default)
            for index, beta in enumerate(value):
                _check_beta(config, name, beta, field.default[index], index)


@dataclass(frozen=True, kw_only=True)
class MuonConfig:
    """Muon: momentum, then Newton-Schulz orthogonalisation, then a shape-dependent scale."""

    momentum: float = 0.95
    """EMA coefficient of the momentum buffer: ``M <- momentum*M + (1-momentum)*G``."""
    nesterov: bool = False
    """Orthogonalise ``(1-momentum)*G + momentum*M`` instead of ``M``."""
    coefficients: str = "quintic"
    """Key of :data:`megatron.canzona.optim.newton_schulz.NS_COEFFICIENTS`."""
    num_ns_steps: int = 5
    """Number of Newton-Schulz iterations."""
    ns_dtype: ComputeDtype = "bfloat16"
    """Dtype of the Newton-Schulz matmuls; normalisation and state stay in fp32 (or fp64)."""
    ns_method: NSMethod = "standard"
    """Newton-Schulz iterated on the matrix (standard), on its Gram matrix (gram: fewer FLOPs
    for rectangular matrices), or whichever the cost model finds cheaper per shape (auto)."""
    ns_measured: tuple[tuple[int, int, str], ...] = ()
    """``(short side, long side, method)`` measured faster on this machine (a calibration): what
    ``auto`` takes for those shapes; the FLOP rule decides the others."""
    eps: float = 1e-7
    """Floor on the Frobenius norm used to normalise the input of Newton-Schulz."""
    exact_norm: bool = False
    """Sum that norm's squares in integers (:mod:`~megatron.canzona.optim.exact_norm`): the same
    bits however the matrix is cut, so holders that divide their pieces by it before sending them
    (Megatron-FSDP's narrow gathers) make what one device makes. Off: ``torch.linalg.matrix_norm``."""
    scale_mode: MuonScaleMode = "moonlight"
    """Shape scale: moonlight 0.2*sqrt(max(m,n)), spectral sqrt(max(m,n)), shape_scaling
    sqrt(max(1,m/n)), unit_rms_norm sqrt(m/n), none 1 (m rows, n columns)."""
    extra_scale_factor: float = 1.0
    """Multiplies the scale above (Megatron's ``--muon-extra-scale-factor``)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.exact_norm and self.ns_dtype == "float64":
            raise FieldError(type(self), "exact_norm", self.exact_norm,
                             "takes fp32 inputs (their squares are exact in fp64); Newton-Schulz in float64 has fp64 ones",
                             False)
        if self.coefficients not in NS_COEFFICIENTS:
            raise ValueError(
                f"MuonConfig.coefficients={self.coefficients!r} is unknown; use one of "
                f"{sorted(NS_COEFFICIENTS)} or register a new set in NS_COEFFICIENTS."
            )


@dataclass(frozen=True, kw_only=True)
class ShampooConfig:
    """Shampoo with Adam grafting: ``L^(-1/r) M R^(-1/r)`` rescaled to Adam's update norm."""

    momentum: float = 0.9
    """EMA coefficient of the first moment ``M`` that gets preconditioned (Adam's beta1)."""
    statistics: Literal["ema", "sum"] = "ema"
    """``ema``: L <- b*L + (1-b)*G G^T; ``sum``: L <- L + G G^T (original Shampoo)."""
    shampoo_beta: float = 0.95
    """EMA coefficient ``b`` of the statistics when ``statistics == "ema"``."""
    eps: float = 1e-12
    """Added to the eigenvalues of L and R before the inverse root."""
    eps_mode: Literal["absolute", "relative"] = "absolute"
    """absolute: lambda + eps; relative: lambda + eps * lambda_max (scale-free)."""
    inverse_root: int = 4
    """r in L^(-1/r); 4 is Shampoo's choice for matrices (two factors of one 1/2 root)."""
    root_dtype: RootDtype = "float32"
    """Dtype of the eigendecomposition used for the inverse roots (one that fails is
    retried in fp64 with a diagonal shift, else the previous roots are kept)."""
    precondition_frequency: int = 10
    """Recompute the inverse roots every f steps; statistics update every step."""
    stagger_refresh: bool = True
    """The optimizers refresh each matrix at steps 1 and ``1 + o + k f`` with an offset ``o``
    from its name (:func:`~megatron.canzona.optim.common.refresh_offset`), so that about
    1/f of the matrices refresh in any step; ``False``: all at steps 1, 1+f, 1+2f, ..."""
    max_precond_dim: int = 10000
    """A side longer than this keeps a diagonal statistic instead of a dense one."""
    grafting: Literal["adam", "none"] = "adam"
    """adam: rescale each matrix's direction to the Frobenius norm of Adam's direction."""
    graft_beta2: float = 0.999
    """EMA coefficient of the grafting second moment."""
    graft_eps: float = 1e-8
    """Epsilon of the grafting Adam denominator."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class SOAPConfig:
    """SOAP (Vyas et al. 2024): Adam in the eigenbasis of Shampoo's statistics."""

    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's (beta1, beta2), applied in the rotated space."""
    shampoo_beta: float = 0.99
    """EMA coefficient of the statistics L and R."""
    eps: float = 1e-8
    """Adam's epsilon."""
    precondition_frequency: int = 10
    """Refresh the eigenbasis at step 1 (eigh), then every f steps (power iteration + QR)."""
    stagger_refresh: bool = True
    """Offset each matrix's refresh steps by its name, as :attr:`ShampooConfig.stagger_refresh`."""
    max_precond_dim: int = 10000
    """A side longer than this is not rotated (identity basis, no statistic kept)."""
    correct_bias: bool = True
    """Adam bias correction of both moments."""
    correct_shampoo_beta_bias: bool = False
    """Bias-correct the statistics EMA (emerging-optimizers' default ties this to correct_bias)."""
    refresh: Literal["qr", "eigh"] = "qr"
    """How later refreshes recompute the basis; the first one always uses eigh."""
    power_iter_steps: int = 1
    """Power-iteration + QR rounds per refresh when ``refresh == "qr"``."""
    eigh_dtype: RootDtype = "float32"
    """Dtype of the eigendecompositions."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class AdamWConfig:
    """AdamW for elementwise parameters (embeddings, output layer, norms, biases)."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2)."""
    eps: float = 1e-8
    """Added to the square root of the bias-corrected second moment."""

    def __post_init__(self) -> None:
        check_fields(self)