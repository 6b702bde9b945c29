"""Fixes for Megatron-Core 0.19.2 bugs that Canzona's runs and baselines would otherwise hit.

Each fix is the factory of one wrapper of an upstream attribute, without changing the math;
which attribute, and for which runs, is a row of :data:`canzona_patches.registry.PATCHES`
(the layer-wise and DistributedOptimizer fixes only for runs of Megatron's own optimizers,
the baselines; the iteration numbering for every ``pretrain_gpt.py`` run).

* **Layer-wise Muon in fp32** (:func:`keeping_config`). Canzona is compared
  against Megatron's layer-wise Muon (``--optimizer muon --use-distributed-optimizer``).
  ``LayerWiseDistributedOptimizer.__init__`` (optimizer/layer_wise_optimizer.py): without
  ``bf16`` its children are raw torch optimizers with no ``config``, so it takes
  ``config=None`` from them, and ``get_megatron_optimizer`` then fails the
  ``ChainedOptimizer`` check that every chained optimizer shares one config (fp32 Muon with
  AdamW for the embeddings cannot be built), and its step calls ``prepare_grads`` on those
  raw optimizers, which have none. The fix sets the config it was given and, as its bf16
  path wraps each child in ``Float16OptimizerWithFloat16Params``, wraps each fp32 child in
  Megatron's ``FP32Optimizer``.
* **Resuming Megatron's distributed AdamW on torch's optimizers** (no Apex or Transformer
  Engine, as on CPU; :func:`allocating_state_first`, :func:`loading_exactly`,
  :func:`restoring_moments`): a ``torch_dist`` or legacy ``torch`` load fails, or resumes
  with a wrong step count.
* **The iteration a NaN is reported at** (:func:`numbering_the_step`). ``RerunStateMachine``
  counts from 0 internally and adds 1 in every message; ``train()`` sets its
  ``current_iteration`` to the number of steps done (training.py:3512), and
  ``should_run_forward_backward`` adds 1 before each step (rerun_state_machine.py:303), so
  "NaN detected ... at iteration #N" names the step after the one that failed. The fix sets
  it before each ``train_step`` to that step's 0-based index.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from canzona_patches.version import require_pinned_megatron

require_pinned_megatron()

from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer  # noqa: E402
from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine  # noqa: E402


def keeping_config(init: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``LayerWiseDistributedOptimizer.__init__`` that lets fp32 layer-wise Muon chain with the
    distributed optimizer (see the module docstring)."""

    @functools.wraps(init)
    def init_keeping_config(self, optimizers, config, *args, init_state_fn_list=None, **kwargs):
        init(self, optimizers, config, *args, init_state_fn_list=init_state_fn_list, **kwargs)
        self.config = config
        if not (config.bf16 or config.fp16):
            fns = init_state_fn_list or [None] * len(self.chained_optimizers)
            self.chained_optimizers = [
                opt if isinstance(opt, MegatronOptimizer) else FP32Optimizer(opt, config, fn)
                for opt, fn in zip(self.chained_optimizers, fns)
            ]

    return init_keeping_config


def numbering_the_step(train_step: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``training.train_step`` that first sets the rerun state machine to the step about to run, so
    NaN and rerun reports name it."""

    @functools.wraps(train_step)
    def train_step_numbered(*args: Any, iteration: int | None = None, **kwargs: Any) -> Any:
        machine = get_rerun_state_machine()
        if iteration is not None and machine.state == RerunState.NOT_RUNNING_YET:
            machine.current_iteration = iteration - 1  # the step about to run is 0-based ``iteration``
        return train_step(*args, iteration=iteration, **kwargs)

    return train_step_numbered


def restoring_moments(load_parameter_state: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``DistributedOptimizer.load_parameter_state`` (the legacy ``--ckpt-format torch`` load of
    main parameters and moments) fixed for torch's own optimizers.

    * Under ``torch.no_grad()``, for the in-place copy into views of leaf parameters described
      in :func:`loading_exactly`.
    * Without the ``step`` tensors: ``_set_main_param_and_optimizer_states`` copies every tensor
      of a parameter's state from the file (distrib_optimizer.py:1222), which holds the
      parameter and moments only, so torch's AdamW ``step`` is a ``KeyError``. The steps, set
      by the ``load_state_dict`` that precedes this call, are put back afterwards."""

    @functools.wraps(load_parameter_state)
    def load_parameter_state_restoring_moments(self: Any, *args: Any, **kwargs: Any) -> Any:
        steps = {param: state.pop("step") for param, state in self.optimizer.state.items()
                 if isinstance(state.get("step"), torch.Tensor)}
        try:
            with torch.no_grad():
                return load_parameter_state(self, *args, **kwargs)
        finally:
            for param, step in steps.items():
                self.optimizer.state[param]["step"] = step

    return load_parameter_state_restoring_moments


def loading_exactly(load_state_dict: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``DistributedOptimizer.load_state_dict`` fixed for torch's own optimizers.

    * Under ``torch.no_grad()``: with fp32 parameters the main parameters are views of the
      (leaf, requires-grad) model parameters, and ``_set_main_param_and_optimizer_states``
      copies into them in place (distrib_optimizer.py:1225), which autograd refuses.
    * The saved step count, one tensor per parameter: torch's AdamW keeps ``step`` in its state.
      Upstream sets every state's ``step`` to one shared tensor from the saved param groups
      (:1026-1032), which AdamW then increments in place once per parameter; and the
      ``dp_reshardable`` load copies the *pre-load* local ``step`` back over it
      (a ``LocalNonpersistentObject``, :1947, copied at :1225). Either way the bias correction
      after a resume is wrong."""

    @functools.wraps(load_state_dict)
    def load_state_dict_exactly(self: Any, state_dict: dict) -> None:
        groups = (state_dict.get("optimizer") or {}).get("param_groups", []) if isinstance(state_dict, dict) else []
        saved_steps = {group["step"] for group in groups if group.get("step") is not None}
        with torch.no_grad():
            load_state_dict(self, state_dict)
        for state in getattr(self.optimizer, "state", {}).values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                value = float(next(iter(saved_steps))) if len(saved_steps) == 1 else float(step)
                state["step"] = torch.tensor(value, dtype=step.dtype, device=step.device)

    return load_state_dict_exactly


def allocating_state_first(sharded_state_dict: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``DistributedOptimizer.sharded_state_dict`` that can load into a fresh torch optimizer.

    Without Apex or Transformer Engine (CPU) the inner optimizer is ``torch.optim.AdamW``, whose
    state is empty until its first step, and ``DistributedOptimizer.state_dict`` asserts one
    ``step`` over that empty state (distrib_optimizer.py:839): ``--load`` of a stock
    distributed-optimizer checkpoint fails. Allocate the state first, as upstream does for
    ``fsdp_dtensor`` (``_init_optimizer_states_with_dummy_values``, :1643); every value it
    touches is then overwritten by the load."""

    @functools.wraps(sharded_state_dict)
    def sharded_state_dict_allocated(self: Any, model_sharded_state_dict: Any = None, is_loading: bool = False,
                                     *args: Any, **kwargs: Any) -> Any:
        if is_loading and not self.is_stub_optimizer and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return sharded_state_dict(self, {} if model_sharded_state_dict is None else model_sharded_state_dict,
                                  is_loading, *args, **kwargs)

    return sharded_state_dict_allocated


def one_read_l2_norm(l2_norm: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """Megatron's local ``multi_tensor_l2norm`` stand-in (``megatron.core.utils.
    local_multi_tensor_l2_norm``, used where neither Apex nor Transformer Engine is installed)
    with one device-to-host read instead of one per tensor.

    Upstream takes each tensor's norm on the device, then builds a host tensor of them with
    ``torch.tensor(list_of_device_scalars)``: a synchronising read per tensor (per parameter of
    the optimizer, in every step's clip). Here the same per-tensor norms are stacked and copied
    to the host at once, and reduced there by upstream's own expression (``torch.norm`` of the
    fp32 host vector), so the norm is bitwise upstream's. Cost per step and rank: one read
    instead of one per parameter; no buffer beyond the vector of norms."""

    @functools.wraps(l2_norm)
    def l2_norm_one_read(chunk_size: int, noop_flag: Any, tensor_lists: list, per_tensor: bool, *args: Any):
        if per_tensor or not tensor_lists[0]:
            return l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
        norms = [torch.norm(tensor) for tensor in tensor_lists[0]]
        total = torch.norm(torch.stack(norms).to("cpu", torch.float32))
        return total.reshape(1).to(norms[0].device), None

    return l2_norm_one_read


def state_on_every_rank(preprocess: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``checkpointing.preprocess_fsdp_dtensor_state_dict`` whose optimizer state names the same
    parameters, in the same order, on every rank. Megatron-FSDP's optimizer keeps no state for a
    parameter of which a rank's shard holds no element (torch's Adam never steps it), and the
    preprocessing runs collectives per state entry (``handle_swiglu_in_state_dict`` splits each
    fc1's moments, ``preprocess_state_dict_for_uneven_dtensor`` gathers every ``DTensor``'s chunk
    bounds): a rank without some entry skips those collectives and the save (or load) hangs.
    Here the ranks agree on the union of their entries (one ``all_gather_object``); an entry a
    rank lacks gets zero-element moments (``zeros_like`` of its ``DTensor`` parameter) and the
    others' step, for the preprocessing only: the optimizer's own state is unchanged."""
    from megatron.core.transformer.fsdp_dtensor_checkpoint import expert_param_local_key

    @functools.wraps(preprocess)
    def preprocess_on_every_rank(args: Any, raw_state_dict: dict, model: Any) -> dict:
        optimizer = raw_state_dict.get("optimizer")
        if not (isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
                and torch.distributed.is_initialized()):
            return preprocess(args, raw_state_dict, model)
        state = optimizer["state"]
        mine = {key: {sub: torch.is_tensor(value) and value.dim() > 0 for sub, value in entry.items()}
                for key, entry in state.items() if isinstance(entry, dict)}
        everyone: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
        union: dict[str, dict[str, bool]] = {}
        for theirs in everyone:
            for key, subs in theirs.items():
                union.setdefault(key, {}).update(subs)
        if set(union) == set(state) and list(state) == sorted(state):
            return preprocess(args, raw_state_dict, model)
        experts = getattr(getattr(model, "config", None), "num_moe_experts", None)
        step = next((e["step"] for e in state.values() if isinstance(e, dict) and "step" in e), None)
        filled = {}
        for key in sorted(union):
            if key in state:
                filled[key] = state[key]
                continue
            param = model.get_parameter(expert_param_local_key(key[len("module."):], experts))
            filled[key] = {sub: torch.zeros_like(param) if shaped else step if sub == "step" else None
                           for sub, shaped in union[key].items()}
        filled.update({key: value for key, value in state.items() if key not in filled})
        return preprocess(args, {**raw_state_dict, "optimizer": {**optimizer, "state": filled}}, model)

    return preprocess_on_every_rank


class _UnwrappedLookup:
    """A model whose ``get_parameter`` also finds ``module.<name>`` as ``<name>``: the model
    :func:`finding_unwrapped_params` hands Megatron's SwiGLU split."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def get_parameter(self, target: str) -> torch.nn.Parameter:
        try:
            return self._model.get_parameter(target)
        except AttributeError:
            if not target.startswith("module."):
                raise
            return self._model.get_parameter(target[len("module."):])


def finding_unwrapped_params(handle: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``handle_swiglu_in_state_dict`` for fp32 models too. It asks the model for
    ``module.<key>`` of each fc1 key of the model state dict, which names the parameter only when
    a ``Float16Module`` sits between Megatron-FSDP and the model (``--bf16``, ``--fp16``); in fp32
    the key already carries that ``module.`` and the lookup fails. The model it gets answers both."""

    @functools.wraps(handle)
    def handle_fp32_too(model: Any, *args: Any, **kwargs: Any) -> Any:
        return handle(_UnwrappedLookup(model), *args, **kwargs)

    return handle_fp32_too
