"""Run Megatron-Core 0.19.2 on CPU with gloo by redirecting its hard-coded CUDA use.

Megatron-Core assumes a GPU: it allocates with ``device=torch.cuda.current_device()`` or
``device='cuda'``, fences CUDA streams and events, keeps its tensor-parallel RNG in CUDA
generators and accepts only ``'torch.cuda.*Tensor'`` types in its optimizers. On a machine
without CUDA every one of those raises. :func:`enable_cpu_mode` redirects them to CPU, and
does nothing at all when ``torch.cuda.is_available()`` is True.

What it patches (attribute assignments that last for the life of the process, which is
meant to be a CPU test or tool process; nothing is undone):

1. ``torch`` as seen by the Megatron modules in :data:`CPU_TORCH_MODULES` (and only
   there) becomes :class:`_CpuTorch`, which forwards everything to real ``torch`` except

   * ``torch.cuda`` -> :data:`CPU_CUDA`: ``current_device()`` gives ``cpu``; streams and
     events are no-op stand-ins (:class:`NullStream`, :class:`NullEvent`);
     ``synchronize``/``empty_cache`` do nothing; memory queries answer 0; the CUDA RNG
     calls use the CPU default generator. Other attributes fall through to real
     ``torch.cuda``.
   * the tensor factories in :data:`_FACTORIES` map a CUDA ``device=`` argument
     (``'cuda'``, ``'cuda:0'``, an int, a CUDA ``torch.device``) to CPU.

   Megatron-Core writes ``torch.cuda.X`` and ``torch.zeros(..., device='cuda')`` in some
   two hundred places; swapping the module global keeps the redirect out of every other
   library and of the tests themselves. A Megatron module not in the list still raises
   "Found no NVIDIA driver" on its first CUDA call: add it to the list.
2. ``megatron.core.tensor_parallel.random``: ``CudaRNGStatesTracker`` becomes
   :class:`CpuRNGStatesTracker`, whose ``add``/``fork`` save and restore the CPU default
   generator; ``_get_cuda_rng_state``/``_set_cuda_rng_state`` read/write the CPU state.
3. While one of :data:`_PRETEND_CUDA_FUNCTIONS` runs, and only then, a CPU tensor's
   ``type()`` answers with its ``'torch.cuda.*Tensor'`` name and its ``cuda()`` returns the
   tensor itself. Those functions route parameters by ``param.type() ==
   'torch.cuda.FloatTensor'`` (rejecting anything else) or move CPU data with ``.cuda()``.
   ``Tensor.type``/``Tensor.cuda`` are replaced by pass-throughs that behave exactly as
   before outside those calls.

4. :func:`enable_cpu_training_mode` (for ``pretrain_gpt.py``) adds what
   ``megatron.training`` needs: hook 1 for :data:`CPU_TORCH_TRAINING_MODULES` (with one CPU
   "device" per process), hook 3 around ``training.get_model``, ``allow_no_cuda=True`` for
   ``initialize_megatron`` and a CUDA-free ``get_device_arch_version`` for ``validate_args``.

See ``docs/megatron-cpu-notes.md`` for the upstream line each hook exists for.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from canzona_patches.version import require_pinned_megatron

require_pinned_megatron()

import megatron.core.tensor_parallel.random as _random  # noqa: E402  (after the version check)

_CPU = torch.device("cpu")
_target = _CPU
"""Where Megatron's CUDA allocations land: the CPU, or the meta device for a dry run."""


class NullEvent:
    """CPU stand-in for ``torch.cuda.Event``: work on CPU is already complete when issued."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class NullStream:
    """CPU stand-in for ``torch.cuda.Stream``: one in-order CPU stream, so fences are no-ops."""

    device = _CPU

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> NullEvent:
        return event if event is not None else NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NullStream)

    def __hash__(self) -> int:
        return hash(NullStream)


_THE_STREAM = NullStream()


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _null_stream_context(stream_or_device: Any = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext(stream_or_device)


class _CpuCuda:
    """What ``torch.cuda`` looks like to Megatron modules in CPU mode (see module docstring)."""

    Stream = NullStream
    Event = NullEvent
    current_stream = staticmethod(lambda device=None: _THE_STREAM)
    default_stream = staticmethod(lambda device=None: _THE_STREAM)
    stream = staticmethod(_null_stream_context)
    device = staticmethod(_null_stream_context)  # the `with torch.cuda.device(i):` form
    current_device = staticmethod(lambda: _target)
    set_device = staticmethod(_no_op)
    device_count = staticmethod(_zero)
    synchronize = staticmethod(_no_op)
    empty_cache = staticmethod(_no_op)
    memory_allocated = staticmethod(_zero)
    max_memory_allocated = staticmethod(_zero)
    memory_reserved = staticmethod(_zero)
    max_memory_reserved = staticmethod(_zero)
    reset_peak_memory_stats = staticmethod(_no_op)
    memory_stats = staticmethod(lambda device=None: {})
    is_current_stream_capturing = staticmethod(lambda: False)
    manual_seed = staticmethod(torch.manual_seed)
    get_rng_state = staticmethod(lambda device="cpu": torch.get_rng_state())
    set_rng_state = staticmethod(lambda new_state, device="cpu": torch.set_rng_state(new_state))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


CPU_CUDA = _CpuCuda()
"""The single ``torch.cuda`` stand-in handed to patched Megatron modules."""

_FACTORIES = frozenset(
    {
        "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "empty_strided",
        "rand", "randn", "randint", "empty_like", "zeros_like", "ones_like", "full_like",
    }
)  # fmt: skip


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def factory_on_cpu(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _target
        return factory(*args, **kwargs)

    return factory_on_cpu


class _CpuTorch:
    """``torch`` as seen by a patched Megatron module: real torch but for CUDA devices."""

    cuda = CPU_CUDA

    def __init__(self, cuda: _CpuCuda | None = None) -> None:
        if cuda is not None:
            self.cuda = cuda  # the instance attribute shadows the class default
        self._factories = {name: _on_cpu(getattr(torch, name)) for name in _FACTORIES}

    def __getattr__(self, name: str) -> Any:
        factory = self._factories.get(name)
        return factory if factory is not None else getattr(torch, name)


CPU_TORCH_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.module",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.layer_wise_optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
)
"""Megatron modules whose ``torch`` global becomes :class:`_CpuTorch` (hook 1)."""


class CpuRNGStatesTracker(_random.CudaRNGStatesTracker):
    """Megatron's named RNG states, kept as CPU generator states (hook 2).

    Same bookkeeping as ``CudaRNGStatesTracker``; ``add`` and ``fork`` swap the state of
    the CPU default generator instead of the CUDA one. Upstream ``fork`` also warns when
    the CPU state changes inside the fork, which on CPU is the whole point, so it is
    rewritten rather than inherited.
    """

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked; pick a different seed.")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked.")
        self._is_initialized = True
        self.seeds_.add(seed)
        outer_state = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer_state)

    @contextlib.contextmanager
    def fork(self, name: str = _random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added to the tracker.")
        outer_state = torch.get_rng_state()
        outer_name = self._current_state_name
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name


def _get_cpu_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _install_rng_tracker() -> None:
    """Hook 2: make ``initialize_rng_tracker`` build :class:`CpuRNGStatesTracker`."""
    _random.CudaRNGStatesTracker = CpuRNGStatesTracker
    _random._get_cuda_rng_state = _get_cpu_rng_state
    _random._set_cuda_rng_state = _set_cpu_rng_state
    tracker = _random._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, CpuRNGStatesTracker):
        # Built before CPU mode: let the next model_parallel_cuda_manual_seed rebuild it.
        _random._CUDA_RNG_STATE_TRACKER = None
        _random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


_REAL_TENSOR_TYPE = torch.Tensor.type
_REAL_TENSOR_CUDA = torch.Tensor.cuda
_pretend_depth = 0  # > 0 while a function of _PRETEND_CUDA_FUNCTIONS runs


def _tensor_type(self: torch.Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
    answer = _REAL_TENSOR_TYPE(self, dtype, *args, **kwargs)
    if dtype is None and _pretend_depth and self.device.type in ("cpu", "meta"):
        return "torch.cuda." + answer.rsplit(".", 1)[-1]
    return answer


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if _pretend_depth and self.device.type in ("cpu", "meta"):
        return self
    return _REAL_TENSOR_CUDA(self, *args, **kwargs)


def _pretending_cuda(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def pretending_cuda(*args: Any, **kwargs: Any) -> Any:
        global _pretend_depth
        _pretend_depth += 1
        try:
            return function(*args, **kwargs)
        finally:
            _pretend_depth -= 1

    pretending_cuda.__canzona_cpu_hook__ = True
    return pretending_cuda


_PRETEND_CUDA_FUNCTIONS = (
    # param.type() in ['torch.cuda.HalfTensor', ...] / == 'torch.cuda.FloatTensor' routing:
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),  # bound by import
    # tensor.cuda() on CPU data:
    ("megatron.core.tensor_parallel.data", "broadcast_data"),
    ("megatron.core.tensor_parallel", "broadcast_data"),  # re-exported binding
    ("megatron.core.optimizer.distrib_optimizer",
     "DistributedOptimizer.get_parameter_state_dp_zero"),
    ("megatron.core.models.common.language_module.language_module",
     "LanguageModule.setup_embeddings_and_output_layer"),
    ("megatron.core.utils", "check_param_hashes_across_dp_replicas"),
)  # fmt: skip
"""(module, qualified name) of the functions hook 3 wraps; each binding needs its own row."""


def _install_pretend_cuda() -> None:
    """Hook 3: CPU tensors pretend to be CUDA tensors inside :data:`_PRETEND_CUDA_FUNCTIONS`."""
    torch.Tensor.type = _tensor_type
    torch.Tensor.cuda = _tensor_cuda
    _wrap_pretending_cuda(_PRETEND_CUDA_FUNCTIONS)


def _wrap_pretending_cuda(functions: tuple[tuple[str, str], ...]) -> None:
    for module_name, qualname in functions:
        *owner_path, name = qualname.split(".")
        owner = importlib.import_module(module_name)
        for part in owner_path:
            owner = getattr(owner, part)
        function = getattr(owner, name)
        if not getattr(function, "__canzona_cpu_hook__", False):
            setattr(owner, name, _pretending_cuda(function))


_cpu_mode = False


def cpu_mode_enabled() -> bool:
    """True once :func:`enable_cpu_mode` has redirected Megatron-Core to CPU."""
    return _cpu_mode


def enable_cpu_mode(*, meta: bool = False) -> bool:
    """Redirect Megatron-Core's CUDA use to CPU when CUDA is unavailable; idempotent.

    Call it before building models, DDP wrappers or optimizers. Returns True when CPU mode
    is (now) on, False when CUDA is available and nothing was touched. With ``meta`` (dry
    runs, CUDA or not) every allocation lands on the meta device instead: shapes and dtypes,
    no storage, so a full-size rank fits in one process.
    """
    global _cpu_mode, _target
    if torch.cuda.is_available() and not meta:
        return False
    wanted = torch.device("meta") if meta else _CPU
    if _cpu_mode:
        if wanted != _target:
            raise RuntimeError(f"CPU mode already redirects CUDA to {_target}; one process, one target")
        return True
    _target = wanted
    cpu_torch = _CpuTorch()
    for module_name in CPU_TORCH_MODULES:
        importlib.import_module(module_name).torch = cpu_torch
    _install_rng_tracker()
    _install_pretend_cuda()
    _cpu_mode = True
    return True


# --- megatron.training (pretrain_gpt.py) -------------------------------------------------


class _CpuCudaOneDevice(_CpuCuda):
    """``torch.cuda`` for the :data:`CPU_TORCH_TRAINING_MODULES`: one CPU "device" per process.

    ``megatron.training.initialize`` runs ``initialize_model_parallel`` and seeds the
    tensor-parallel RNG tracker only when ``torch.cuda.device_count() > 0``
    (``_initialize_distributed``, initialize.py:270/358; ``_set_random_seed``, :447).
    """

    device_count = staticmethod(lambda: 1)


CPU_TORCH_TRAINING_MODULES = (
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.utils.common_utils",
    "megatron.training.checkpointing",
)
"""``megatron.training`` modules whose ``torch`` global becomes :class:`_CpuTorch` with
:class:`_CpuCudaOneDevice` (hook 4); see docs/megatron-cpu-notes.md for the call sites."""

_PRETEND_CUDA_TRAINING_FUNCTIONS = (
    # get_model moves every chunk with model_module.cuda(torch.cuda.current_device()):
    ("megatron.training.training", "get_model"),
)  # fmt: skip
"""Hook 3's windows for ``megatron.training`` (same mechanism, separate list: importing
``megatron.training`` costs seconds that Megatron-Core-only users need not pay)."""


def _allowing_no_cuda(initialize_megatron: Callable[..., Any]) -> Callable[..., Any]:
    """``initialize_megatron`` with ``allow_no_cuda=True`` (it asserts CUDA otherwise)."""

    @functools.wraps(initialize_megatron)
    def initialize_megatron_on_cpu(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    initialize_megatron_on_cpu.__canzona_cpu_hook__ = True
    return initialize_megatron_on_cpu


def _no_cuda_arch() -> int:
    """Stand-in for ``get_device_arch_version`` (common_utils.py:502), which asks CUDA for
    device 0's compute capability; ``validate_args`` (arguments.py:1414, 1444, 1484) calls it
    for TP/CP > 1. 0 = no CUDA architecture: the pre-Blackwell branches apply."""
    return 0


_cpu_training_mode = False


def enable_cpu_training_mode() -> bool:
    """:func:`enable_cpu_mode`, plus the redirects ``megatron.training``'s loop needs; idempotent.

    Hook 4: the :data:`CPU_TORCH_TRAINING_MODULES` see :class:`_CpuTorch` (one CPU device
    per process); hook 3's pretend-CUDA window wraps ``training.get_model``; the
    ``initialize_megatron`` that ``training.pretrain`` calls gets ``allow_no_cuda=True``;
    ``arguments.get_device_arch_version`` answers 0 (:func:`_no_cuda_arch`).
    Returns False (and touches nothing) when CUDA is available.
    """
    global _cpu_training_mode
    if not enable_cpu_mode():
        return False
    if _cpu_training_mode:
        return True
    cpu_torch = _CpuTorch(cuda=_CpuCudaOneDevice())
    for module_name in CPU_TORCH_TRAINING_MODULES:
        importlib.import_module(module_name).torch = cpu_torch
    _wrap_pretending_cuda(_PRETEND_CUDA_TRAINING_FUNCTIONS)
    importlib.import_module("megatron.training.arguments").get_device_arch_version = _no_cuda_arch
    training = importlib.import_module("megatron.training.training")
    if not getattr(training.initialize_megatron, "__canzona_cpu_hook__", False):
        training.initialize_megatron = _allowing_no_cuda(training.initialize_megatron)
    _cpu_training_mode = True
    return True
