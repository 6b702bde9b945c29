"""``torch.optim.Optimizer`` front ends: Muon, Shampoo and SOAP for one device.

Matrix parameters go through the update functions (fused ones split by the group's
``fused_layout``); everything else goes through AdamW with the same group ``lr`` and
``weight_decay``. Keys a param group may carry, besides ``params``:

* ``lr``, ``weight_decay``: decoupled, ``p <- p - lr*wd*p - lr*D``;
* ``config``: the matrix optimizer's config (:class:`MuonConfig`, ...);
* ``adamw_config``: :class:`AdamWConfig` for the group's non-matrix parameters;
* ``matrix``: ``True``/``False`` forces the route, ``None`` means "2-D -> matrix";
* ``fused_layout``: a :class:`~megatron.canzona.optim.split.QKVLayout` or
  :class:`~megatron.canzona.optim.split.GateUpLayout` for every parameter of the group.

:func:`~megatron.canzona.optim.split.build_param_groups` builds these groups from a
model's named parameters (and their ``names``, which stagger Shampoo's and SOAP's refresh
steps per matrix). With ``batch_same_shape=True`` same-shape matrices of a group (including
the pieces of split matrices) are updated in one batched call on a stacked state, made at
their first step, of which each matrix's state dict holds views, so no step copies state;
the result equals the per-matrix loop.

State of a matrix parameter is ``{"pieces": [state dict per piece]}``; of an AdamW
parameter, the AdamW state dict itself. All of it is fp32, even for bf16 parameters,
and :meth:`load_state_dict` keeps it so (``torch.optim`` would cast it to the
parameter dtype).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, ClassVar

import torch

from megatron.canzona.optim.adamw import AdamWState, adamw_foreach
from megatron.canzona.optim.adaptive_muon import (
    AdaptiveMuonConfig,
    AdaptiveMuonSourceState,
    AdaptiveMuonState,
    adaptive_muon_from_source,
    adaptive_muon_update,
)
from megatron.canzona.optim.common import OptimizerState, Refresh, apply_update, refresh_due, refresh_offset
from megatron.canzona.optim.config import AdamWConfig, MuonConfig, ShampooConfig, SOAPConfig
from megatron.canzona.optim.muon import (
    MuonSourceState,
    MuonState,
    muon_advance,
    muon_direction,
    muon_from_source,
    muon_update,
)
from megatron.canzona.optim.shampoo import ShampooState, shampoo_update
from megatron.canzona.optim.soap import SOAPState, soap_update
from megatron.canzona.optim.split import GateUpLayout, QKVLayout, merge_pieces, split_pieces

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
_Job = tuple[Any, int, torch.Tensor]
"""``(owner, piece index, gradient piece)``; directions come back by ``(id(owner), piece index)``."""
_log = logging.getLogger(__name__)


class _Stack:
    """A bucket's state stacked along a leading dimension, and its members' state dicts, whose
    tensors are views of it: the batched update runs on the stacked tensors in place."""

    def __init__(self, state: OptimizerState, count: int) -> None:
        """``count`` members (a state may hold no tensor: a host's Muon state is its step)."""
        self.state = state
        self.tensors = state.tensors()
        self.views = [{"step": state.step, **{name: t[i] for name, t in self.tensors.items()}} for i in range(count)]

    def backs(self, stored: list[dict[str, Any] | None]) -> bool:
        """Whether the members' state dicts still hold this stack's views (a load that
        replaced them, instead of copying into them, breaks that)."""
        return all(
            values is not None and all(values.get(name) is view[name] for name in self.tensors)
            for values, view in zip(stored, self.views)
        )

    def absorb(self, state: OptimizerState) -> None:
        """Copy the tensors an update replaced into the stacked storage and point at it again."""
        _absorb(state, self.tensors)


def _absorb(state: OptimizerState, storage: dict[str, torch.Tensor]) -> None:
    """Copy the tensors of ``state`` an update replaced into ``storage`` (by field) and point
    ``state`` at it again."""
    for name, tensor in storage.items():
        current = getattr(state, name)
        if current is not tensor:
            tensor.copy_(current)
            setattr(state, name, tensor)

@dataclasses.dataclass
class _Staged:
    """A bucket's update run on a staging copy of its state, not yet the state."""

    bucket: list[_Job]
    stack: _Stack | None
    state: OptimizerState
    """The staging copy, updated; with ``deferred``, the state itself, as it was."""
    refresh: Refresh
    config: Any
    deferred: bool = False
    """The optimizer's ``direction_fn`` ran: the state advances at the commit (``advance_fn``)."""


def _staging_copy(state: OptimizerState, spare: OptimizerState | None) -> OptimizerState:
    """``state`` with every tensor copied, into ``spare``'s tensors where they fit (made once;
    the strides too: a product's rounding may depend on its operands' layout, and SOAP's bases
    come from ``eigh`` in column-major order)."""
    buffers = spare.tensors() if spare is not None else {}
    copies = {}
    for name, tensor in state.tensors().items():
        buffer = buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or buffer.stride() != tensor.stride():
            buffer = torch.empty_like(tensor)
        copies[name] = buffer.copy_(tensor)
    return dataclasses.replace(state, **copies)


# Param-group values saved as {"type": name, "fields": {...}} so that checkpoints hold only
# plain containers and load with torch.load(..., weights_only=True).
_GROUP_OBJECTS = ("config", "adamw_config", "fused_layout")
_SERIALIZABLE: dict[str, type[Any]] = {
    cls.__name__: cls
    for cls in (MuonConfig, ShampooConfig, SOAPConfig, AdamWConfig, QKVLayout, GateUpLayout)
}


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and type(value).__name__ in _SERIALIZABLE:
        return {"type": type(value).__name__, "fields": dataclasses.asdict(value)}  # type: ignore[arg-type]
    return value


def _from_plain(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"type", "fields"}:
        return _SERIALIZABLE[value["type"]](**value["fields"])
    return value


def _copy_to_device(value: Any, device: torch.device) -> Any:
    """Deep copy of nested state onto ``device``, keeping every tensor's dtype."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, copy=True)
    if isinstance(value, dict):
        return {k: _copy_to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy_to_device(v, device) for v in value)
    return value


class MatrixOptimizer(torch.optim.Optimizer):
    """Base class: a matrix update function for 2-D parameters, AdamW for the rest."""

    # What a subclass provides: its config type, its state dataclass (with ``create(shape,
    # config, *, device, grad_dtype)``) and its update ``(grad, state, config) -> direction``.
    config_type: ClassVar[type[Any]]
    state_type: ClassVar[type[Any]]
    update_fn: ClassVar[Callable[..., torch.Tensor]]
    """``(grad, state, config, refresh) -> direction``."""
    direction_fn: ClassVar[Callable[..., torch.Tensor] | None] = None
    """Optional: ``update_fn``'s direction without touching the state, which ``advance_fn``
    ``(grad, state, config)`` then updates as ``update_fn`` would: a staged update of such an
    optimizer keeps no copy of its state, and its commit takes the gradients again."""
    advance_fn: ClassVar[Callable[..., Any] | None] = None
    from_source_fn: ClassVar[Callable[..., torch.Tensor] | None] = None
    """Optional, for an optimizer whose state before Newton-Schulz is Muon's momentum: ``update_fn``
    from the Newton-Schulz input ``(source, state, config, refresh) -> direction``, the momentum
    kept by the ranks holding the matrix's rows (:func:`~megatron.canzona.optim.muon.muon_source_`)
    and the rest of the state (``source_state_type``) by its host."""
    source_state_type: ClassVar[type[Any] | None] = None

    def __init__(
        self,
        params: ParamsT,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        config: Any = None,
        adamw_config: AdamWConfig = AdamWConfig(),
        batch_same_shape: bool = True,
    ) -> None:
        """``config`` is the subclass's ``config_type`` (its defaults when omitted)."""
        config = self.config_type() if config is None else config
        if lr < 0:
            raise ValueError(f"lr={lr} must be >= 0.")
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0.")
        defaults = dict(
            lr=lr, weight_decay=weight_decay, config=config, adamw_config=adamw_config,
            matrix=None, fused_layout=None,
        )
        super().__init__(params, defaults)
        self.batch_same_shape = batch_same_shape
        self._stacks: dict[tuple[Any, ...], _Stack] = {}
        self._staged: dict[tuple[Any, ...], _Staged] = {}
        """Bucket -> its update run on a staging copy of its state (``_run_jobs(staged=True)``)."""
        self._spares: dict[tuple[Any, ...], OptimizerState] = {}
        """Bucket -> buffers of the state's shapes, reused by its next staging copy."""
        self._stack_of: dict[Any, tuple[Any, ...]] = {}
        self._names_by_id: dict[int, str] = {}
        for group in self.param_groups:
            self._validate_group(group)

    def _validate_group(self, group: dict[str, Any]) -> None:
        if not isinstance(group["config"], self.config_type):
            raise TypeError(
                f"{type(self).__name__} needs config of type {self.config_type.__name__}, "
                f"got {type(group['config']).__name__}."
            )
        if not isinstance(group["adamw_config"], AdamWConfig):
            got = type(group["adamw_config"]).__name__
            raise TypeError(f"adamw_config must be an AdamWConfig, got {got}.")
        for param in group["params"]:
            if self._is_matrix(group, param) and param.ndim != 2:
                raise ValueError(
                    f"a group with matrix=True holds a {param.ndim}-D tensor of shape "
                    f"{tuple(param.shape)}; reshape it or route it to AdamW (matrix=False)."
                )
        if group["fused_layout"] is not None and group["matrix"] is False:
            raise ValueError(
                "fused_layout is only meaningful for matrix parameters; drop it or set matrix=True."
            )

    @staticmethod
    def _is_matrix(group: dict[str, Any], param: torch.Tensor) -> bool:
        return group["matrix"] if group["matrix"] is not None else param.ndim == 2

    # Stepping -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss

    def _update(self) -> None:
        """Update every parameter that has a gradient, group by group."""
        for group in self.param_groups:
            self._step_matrices(group)
            self._step_elementwise(group)

    def _state_of(self, owner: Any) -> dict[str, Any]:
        """The state dict holding ``owner``'s matrix state (``{"pieces": [...]}``); ``owner``
        is the parameter here, a runtime may key matrix state otherwise."""
        return self.state[owner]

    def _owner_name(self, owner: Any) -> str:
        """The name that staggers ``owner``'s refreshes: the group's ``names`` entry (what
        :func:`~megatron.canzona.optim.split.build_param_groups` records), else its position."""
        if id(owner) not in self._names_by_id:
            params = [p for group in self.param_groups for p in group["params"]]
            for position, param in enumerate(params):
                self._names_by_id.setdefault(id(param), f"param.{position}")
            for group in self.param_groups:
                for param, name in zip(group["params"], group.get("names") or ()):
                    self._names_by_id[id(param)] = name
        return self._names_by_id[id(owner)]

    def _refresh_offset(self, owner: Any, config: Any) -> int:
        frequency = getattr(config, "precondition_frequency", 1)
        if not getattr(config, "stagger_refresh", False) or frequency == 1:
            return 0
        return refresh_offset(self._owner_name(owner), frequency)

    def _declare(self, owner: Any, count: int) -> None:
        """Make room for the state of ``owner``'s ``count`` pieces (allocated per stack)."""
        stored = self._state_of(owner)
        if "pieces" not in stored:
            stored["pieces"] = [None] * count

    def _step_matrices(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None and self._is_matrix(group, p)]
        jobs: list[_Job] = []
        for param in params:
            if param.grad.is_sparse:
                raise TypeError(f"{type(self).__name__} does not support sparse gradients.")
            pieces = split_pieces(param.grad, group["fused_layout"])
            self._declare(param, len(pieces))
            jobs.extend((param, i, piece) for i, piece in enumerate(pieces))
        directions = self._run_jobs(jobs, group["config"])
        for param in params:
            pieces = [directions[(id(param), i)] for i in range(len(self.state[param]["pieces"]))]
            apply_update(
                param, merge_pieces(pieces, group["fused_layout"]), lr=group["lr"], weight_decay=group["weight_decay"],
            )

    def _buckets(self, jobs: list[_Job], config: Any) -> list[list[_Job]]:
        """Jobs batched by shape, dtype, device and step (one each without ``batch_same_shape``),
        each batch ordered by refresh offset so that the members refreshing together are adjacent."""
        buckets: dict[tuple[Any, ...], list[_Job]] = defaultdict(list)
        for job in jobs:
            owner, index, grad = job
            if self.batch_same_shape:
                stored = self._state_of(owner)["pieces"][index]
                step = 0 if stored is None else stored["step"]
                buckets[(tuple(grad.shape), grad.dtype, grad.device, step)].append(job)
            else:
                buckets[(len(buckets),)].append(job)
        return [sorted(bucket, key=lambda job: self._refresh_offset(job[0], config)) for bucket in buckets.values()]

    def _run_jobs(self, jobs: list[_Job], config: Any, *, staged: bool = False,
                  update: Callable[..., torch.Tensor] | None = None) -> dict[tuple[int, int], torch.Tensor]:
        """Run every job, a bucket of same-shape ones in one batched call on its stacked
        state; directions by (owner id, piece). ``staged``: the updates run on staging copies
        of the state and leave the state as it was, until :meth:`commit_staged` makes them the
        state (or :meth:`discard_staged` drops them). ``update``: the update function of these
        jobs, in place of the optimizer's (same arguments)."""
        update_fn = update or self.update_fn
        directions: dict[tuple[int, int], torch.Tensor] = {}
        for bucket in self._buckets(jobs, config):
            grads = [grad for _, _, grad in bucket]
            state, stack = self._bucket_state(bucket, config, grads[0].device, grads[0].dtype)
            refresh = self._refresh(bucket, state.step + 1, config)
            batch = grads[0] if stack is None else torch.stack(grads)
            if staged and self.direction_fn is not None:  # the state advances at the commit
                out = self.direction_fn(batch, state, config, refresh)
                self._staged[self._members(bucket)] = _Staged(bucket, stack, state, refresh, config, deferred=True)
            elif staged:
                members = self._members(bucket)
                state = _staging_copy(state, self._spares.pop(members, None))
                storage = state.tensors()
                out = update_fn(batch, state, config, refresh)
                if stack is not None:  # as a stack keeps what an update replaced: in its storage
                    _absorb(state, storage)
                self._staged[members] = _Staged(bucket, stack, state, refresh, config)
            else:
                out = update_fn(batch, state, config, refresh)
                self._commit(bucket, state, stack)
                self._warn_failed(bucket, refresh, state.step)
            for position, (owner, index, _) in enumerate(bucket):
                directions[(id(owner), index)] = out if stack is None else out[position]
        return directions

    def _warn_failed(self, bucket: list[_Job], refresh: Refresh, step: int) -> None:
        if refresh.failed:
            _log.warning(
                "step %d: the preconditioner refresh of %s did not converge (eigendecomposition, also in "
                "fp64 with a diagonal shift); they keep their previous preconditioner", step,
                ", ".join(self._owner_name(bucket[m][0]) for m in refresh.failed),
            )

    # Staged updates ----------------------------------------------------------------------
    @property
    def staged_count(self) -> int:
        """Buckets updated by a staged run and neither committed nor discarded yet."""
        return len(self._staged)

    def commit_staged(self, grads: Mapping[tuple[Any, int], torch.Tensor] | None = None,
                      owners: Collection[Any] | None = None) -> None:
        """Make the staged updates (of ``owners``' buckets, default all) the state: each
        bucket's staging state takes the place of its state (no copy: the state dicts point at
        it), and the replaced tensors are kept as the next staging copy's buffers; an optimizer
        with ``advance_fn`` advances its state from ``grads`` again (``(owner, piece)``, keyed
        as its buckets' members: the staged gradients). Bit for bit what running the updates
        unstaged does."""
        for members, staged in list(self._staged.items()):
            if owners is not None and any(owner not in owners for owner, _ in members):
                continue
            if staged.deferred:
                if grads is None:
                    raise RuntimeError("this optimizer's staged updates commit with their gradients; pass grads")
                pieces = [grads[member] for member in members]
                assert self.advance_fn is not None
                self.advance_fn(pieces[0] if staged.stack is None else torch.stack(pieces), staged.state, staged.config)
                self._commit(staged.bucket, staged.state, staged.stack)
            else:
                self._spares[members] = self._adopt(staged)
            self._warn_failed(staged.bucket, staged.refresh, staged.state.step)
            del self._staged[members]

    def discard_staged(self) -> None:
        """Drop every staged update; the state stays as it was (the staging buffers are kept)."""
        for members, staged in self._staged.items():
            if not staged.deferred:
                self._spares[members] = staged.state
        self._staged.clear()

    def _adopt(self, staged: _Staged) -> OptimizerState:
        """Point a bucket's state at ``staged.state``; returns the state it replaced."""
        bucket, stack, state = staged.bucket, staged.stack, staged.state
        if stack is None:
            owner, index, _ = bucket[0]
            stored = self._state_of(owner)["pieces"][index]
            replaced = self.state_type.from_dict(dict(stored))
            stored.update(state.as_dict())
            return replaced
        replaced = stack.state
        stack.state, stack.tensors = state, state.tensors()
        for position, view in enumerate(stack.views):
            view.update({name: tensor[position] for name, tensor in stack.tensors.items()}, step=state.step)
        return replaced

    def _members(self, bucket: list[_Job]) -> tuple[Any, ...]:
        """A bucket's identity: its (owner, piece index) pairs, owners by key or ``id``."""
        return tuple((owner if isinstance(owner, str) else id(owner), index) for owner, index, _ in bucket)

    def _refresh(self, bucket: list[_Job], step: int, config: Any) -> Refresh:
        frequency = getattr(config, "precondition_frequency", 1)
        return Refresh(tuple(refresh_due(step, frequency, self._refresh_offset(owner, config)) for owner, _, _ in bucket))

    def _bucket_state(
        self, bucket: list[_Job], config: Any, device: torch.device, grad_dtype: torch.dtype,
    ) -> tuple[OptimizerState, _Stack | None]:
        """The state a bucket updates: a lone piece's own, or the bucket's stacked state, whose
        members' state dicts hold views of it (made on first use, so no step copies state)."""
        members = self._members(bucket)
        if len(bucket) == 1:
            self._retire_stacks(members)
            owner, index, grad = bucket[0]
            pieces = self._state_of(owner)["pieces"]
            if pieces[index] is None:
                pieces[index] = self.state_type.create(grad.shape, config, device=device, grad_dtype=grad_dtype).as_dict()
            return self.state_type.from_dict(pieces[index]), None
        stored = [self._state_of(owner)["pieces"][index] for owner, index, _ in bucket]
        stack = self._stacks.get(members)
        if stack is not None and stack.backs(stored):
            stack.state.step = stored[0]["step"]
            return stack.state, stack
        state = self.state_type.create((len(bucket), *bucket[0][2].shape), config, device=device, grad_dtype=grad_dtype)
        for position, values in enumerate(stored):
            if values is not None:  # state that exists apart (a load replaced it): adopted, once
                for name, value in self.state_type.from_dict(values).tensors().items():
                    getattr(state, name)[position].copy_(value)
                state.step = values["step"]
        stack = _Stack(state, len(bucket))
        for (owner, index, _), view in zip(bucket, stack.views):
            self._state_of(owner)["pieces"][index] = view
        self._retire_stacks(members)
        self._stacks[members] = stack
        self._stack_of.update(dict.fromkeys(members, members))
        return state, stack

    def _retire_stacks(self, members: tuple[Any, ...]) -> None:
        """Forget the stacks these members belonged to (a bucket of other members, e.g. after a
        step without some gradients): their storage lives on only through the views the other
        members still hold, until those are re-stacked too."""
        for member in members:
            old = self._stack_of.pop(member, None)
            if old is not None and old != members:
                self._stacks.pop(old, None)
                self._spares.pop(old, None)

    def _commit(self, bucket: list[_Job], state: OptimizerState, stack: _Stack | None) -> None:
        """Keep what the update did: tensors it replaced (SOAP's bases) and the step."""
        if stack is None:
            owner, index, _ = bucket[0]
            self._state_of(owner)["pieces"][index].update(state.as_dict())
            return
        stack.absorb(state)
        for view in stack.views:
            view["step"] = state.step

    def _elements(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elements of a parameter or gradient this optimizer updates: the tensor itself
        (a subclass whose parameters hold a shard of each tensor returns that shard)."""
        return tensor

    def _step_elementwise(self, group: dict[str, Any]) -> None:
        """AdamW on every non-matrix parameter of the group that has a gradient, fused."""
        params = [p for p in group["params"] if p.grad is not None and not self._is_matrix(group, p)]
        states = []
        for param in params:
            stored = self.state[param]
            if not stored:
                stored.update(AdamWState.create(self._elements(param).shape, device=param.device,
                                                grad_dtype=param.grad.dtype).as_dict())
            states.append(AdamWState.from_dict(stored))
        if not params:
            return
        adamw_foreach([self._elements(p) for p in params], [self._elements(p.grad) for p in params], states,
                      group["adamw_config"], lr=group["lr"], weight_decay=group["weight_decay"])
        for param, state in zip(params, states):
            self.state[param]["step"] = state.step

    # Checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim`` state dict with configs and layouts as plain dicts."""
        packed = super().state_dict()
        for group in packed["param_groups"]:
            for key in _GROUP_OBJECTS:
                group[key] = _to_plain(group.get(key))
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`, keeping the saved (fp32) state dtypes."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key in _GROUP_OBJECTS:
                group[key] = _from_plain(group.get(key))
        # torch.optim casts floating-point state to the parameter's dtype, which would
        # round the fp32 state of bf16 parameters; reload it with the saved dtypes.
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, param in zip(saved_ids, params, strict=True):
            if saved_id in state_dict["state"]:
                self.state[param] = _copy_to_device(state_dict["state"][saved_id], param.device)


class Muon(MatrixOptimizer):
    """Muon for 2-D parameters (see :func:`~megatron.canzona.optim.muon.muon_update`), AdamW
    for the rest. With the default ``moonlight`` scale, AdamW learning rates carry over."""

    config_type = MuonConfig
    state_type = MuonState
    update_fn = staticmethod(muon_update)
    direction_fn = staticmethod(muon_direction)
    advance_fn = staticmethod(muon_advance)
    from_source_fn = staticmethod(muon_from_source)
    source_state_type = MuonSourceState


class Shampoo(MatrixOptimizer):
    """Shampoo with Adam grafting for 2-D parameters
    (see :func:`~megatron.canzona.optim.shampoo.shampoo_update`), AdamW for the rest."""

    config_type = ShampooConfig
    state_type = ShampooState
    update_fn = staticmethod(shampoo_update)


class SOAP(MatrixOptimizer):
    """SOAP for 2-D parameters (see :func:`~megatron.canzona.optim.soap.soap_update`),
    AdamW for the rest."""

    config_type = SOAPConfig
    state_type = SOAPState
    update_fn = staticmethod(soap_update)


class AdaptiveMuon(MatrixOptimizer):
    """AdaMuon or NorMuon for 2-D parameters (see
    :func:`~megatron.canzona.optim.adaptive_muon.adaptive_muon_update`), AdamW for the rest. Its
    second moment advances with the orthogonalised update, so a staged step keeps a staging copy
    of the state, as Shampoo's and SOAP's do."""

    config_type = AdaptiveMuonConfig
    state_type = AdaptiveMuonState
    update_fn = staticmethod(adaptive_muon_update)
    from_source_fn = staticmethod(adaptive_muon_from_source)
    source_state_type = AdaptiveMuonSourceState


MATRIX_OPTIMIZERS: dict[str, type[MatrixOptimizer]] = {"muon": Muon, "shampoo": Shampoo, "soap": SOAP,
                                                       "adaptive_muon": AdaptiveMuon}
"""The matrix optimizers by name. To add one, subclass :class:`MatrixOptimizer` with its
config type, state type and update function, and register it here."""
