"""Run Megatron-Core 0.19.2 on CPU with gloo by redirecting its hard-coded CUDA use.

Megatron-Core assumes a GPU: it allocates with ``device=torch.cuda.current_device()`` or
``device='cuda'``, fences CUDA streams and events, keeps its tensor-parallel RNG in CUDA
generators and accepts only ``'torch.cuda.*Tensor'`` types in its optimizers. On a machine
without CUDA every one of those raises. :func:`enable_cpu_mode` redirects them to CPU, and
does nothing at all when ``torch.cuda.is_available()`` is True.

This module holds the stand-ins and their factories; what is replaced, and when, is the
``cpu`` and ``cpu-training`` groups of :data:`canzona_patches.registry.PATCHES`
(``python -m canzona_patches.registry``). The replacements last for the life of the
process, which is meant to be a CPU test, tool or training process; nothing is undone.

1. ``torch`` as seen by the Megatron modules in ``registry.CPU_TORCH_MODULES`` (and only
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
   library and of the tests themselves.
2. ``megatron.core.tensor_parallel.random``: ``CudaRNGStatesTracker`` becomes
   :class:`CpuRNGStatesTracker`, whose ``add``/``fork`` save and restore the CPU default
   generator; ``_get_cuda_rng_state``/``_set_cuda_rng_state`` read/write the CPU state.
3. While one of ``registry.PRETEND_CUDA_WINDOWS`` runs, and only then, a CPU tensor's
   ``type()`` answers with its ``'torch.cuda.*Tensor'`` name and its ``cuda()`` returns the
   tensor itself. Those functions route parameters by ``param.type() ==
   'torch.cuda.FloatTensor'`` (rejecting anything else) or move CPU data with ``.cuda()``.
   ``Tensor.type``/``Tensor.cuda`` are replaced by pass-throughs that behave exactly as
   before outside those calls.
4. :func:`enable_cpu_training_mode` (for ``pretrain_gpt.py``) adds what
   ``megatron.training`` needs: hook 1 for ``registry.CPU_TORCH_TRAINING_MODULES`` (with one
   CPU "device" per process), hook 3 around ``training.get_model``, ``allow_no_cuda=True``
   for ``initialize_megatron`` and a CUDA-free ``get_device_arch_version`` for
   ``validate_args``.

See ``docs/megatron-cpu-notes.md`` for the upstream line each hook exists for.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from canzona_patches import registry
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
        if kwargs.get("pin_memory"):  # pinning needs an accelerator; without one it raises
            kwargs["pin_memory"] = False
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


_CPU_TORCH = _CpuTorch()


def cpu_torch(original: Any, run: Any = None) -> _CpuTorch:
    """Hook 1's factory (also for the ``torch_dist`` writer's modules): the one stand-in."""
    return _CPU_TORCH


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


def cpu_rng_tracker(original: type, run: Any = None) -> type:
    """Hook 2's factory: ``initialize_rng_tracker`` builds :class:`CpuRNGStatesTracker`."""
    return CpuRNGStatesTracker


def _get_cpu_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def cpu_get_rng_state(original: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    return _get_cpu_rng_state


def cpu_set_rng_state(original: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    return _set_cpu_rng_state


def gathering_unequal_splits_on_gloo(original: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """Megatron's ``_gather_along_first_dim`` with unequal ``output_split_sizes`` (the all-to-all
    token dispatcher at expert TP > 1 gathers each expert-TP rank's tokens) calls the list-form
    ``all_gather``, which gloo refuses for unequal sizes. On gloo each rank's rows are padded to the
    largest split, all-gathered once and cut back: the same rows, copied. Every other call is
    Megatron's."""

    @functools.wraps(original)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if (output_split_sizes is None or len(set(output_split_sizes)) <= 1 or group.size() == 1
                or torch.distributed.get_backend(group) != "gloo"):
            return original(input_, group, output_split_sizes, use_global_buffer)
        widest = max(output_split_sizes)
        padded = input_.new_zeros((widest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((group.size() * widest, *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(gathered, padded, group=group)
        return torch.cat([gathered[r * widest: r * widest + size] for r, size in enumerate(output_split_sizes)])

    return _gather_along_first_dim


def _rebuild_rng_tracker_built_before() -> None:
    """A tracker built before CPU mode holds CUDA states: rebuild it as a CpuRNGStatesTracker."""
    tracker = _random._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, CpuRNGStatesTracker):
        _random.initialize_rng_tracker(force_reset=True)


_pretend_depth = 0  # > 0 while a pretend-CUDA window (registry.PRETEND_CUDA_WINDOWS) runs


def tensor_type_pretending(tensor_type: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """Hook 3: ``Tensor.type`` that answers ``'torch.cuda.*Tensor'`` for CPU (and meta)
    tensors inside a pretend-CUDA window, and as before everywhere else."""

    @functools.wraps(tensor_type)
    def type_pretending(self: torch.Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        answer = tensor_type(self, dtype, *args, **kwargs)
        if dtype is None and _pretend_depth and self.device.type in ("cpu", "meta"):
            return "torch.cuda." + answer.rsplit(".", 1)[-1]
        return answer

    return type_pretending


def tensor_cuda_pretending(tensor_cuda: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """Hook 3: ``Tensor.cuda`` that returns a CPU (or meta) tensor itself inside a window."""

    @functools.wraps(tensor_cuda)
    def cuda_pretending(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _pretend_depth and self.device.type in ("cpu", "meta"):
            return self
        return tensor_cuda(self, *args, **kwargs)

    return cuda_pretending


def pretending_cuda(function: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """Hook 3's window: ``function`` during which CPU tensors answer as CUDA tensors."""

    @functools.wraps(function)
    def pretending(*args: Any, **kwargs: Any) -> Any:
        global _pretend_depth
        _pretend_depth += 1
        try:
            return function(*args, **kwargs)
        finally:
            _pretend_depth -= 1

    return pretending


def cpu_mode_enabled() -> bool:
    """True once :func:`enable_cpu_mode` has redirected Megatron-Core to CPU."""
    return registry.installed(registry.CPU)


def enable_cpu_mode(*, meta: bool = False) -> bool:
    """Redirect Megatron-Core's CUDA use to CPU when CUDA is unavailable; idempotent.

    Call it before building models, DDP wrappers or optimizers. Returns True when CPU mode
    is (now) on, False when CUDA is available and nothing was touched. With ``meta`` (dry
    runs, CUDA or not) every allocation lands on the meta device instead: shapes and dtypes,
    no storage, so a full-size rank fits in one process.
    """
    global _target
    if torch.cuda.is_available() and not meta:
        return False
    wanted = torch.device("meta") if meta else _CPU
    if cpu_mode_enabled() and wanted != _target:
        raise RuntimeError(f"CPU mode already redirects CUDA to {_target}; one process, one target")
    _target = wanted
    registry.install_group(registry.CPU)
    _rebuild_rng_tracker_built_before()
    return True


def split_sizes_on_cpu(original: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``maybe_move_tensor_to_cpu`` (moe_utils.py:1169) for CPU tensors too: with ``as_numpy``
    the all-to-all dispatcher wants host split sizes, which it gets only from CUDA tensors."""

    @functools.wraps(original)
    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move_to_cpu


def torch_norm_with_sequence_parallel(original: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``WrappedTorchNorm.__new__`` (torch_norm.py:35) under sequence parallelism: the norm is
    built as without it, and its weights get ``sequence_parallel = True``, so that
    ``finalize_model_grads`` sums their gradients over the TP group (each TP rank normalises
    its own slice of the sequence), as for transformer-engine's and apex's norms."""

    @functools.wraps(original)
    def new_norm(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return new_norm


# --- megatron.training (pretrain_gpt.py) -------------------------------------------------


class _CpuCudaOneDevice(_CpuCuda):
    """``torch.cuda`` for ``registry.CPU_TORCH_TRAINING_MODULES``: one CPU "device" per process.

    ``megatron.training.initialize`` runs ``initialize_model_parallel`` and seeds the
    tensor-parallel RNG tracker only when ``torch.cuda.device_count() > 0``
    (``_initialize_distributed``, initialize.py:270/358; ``_set_random_seed``, :447).
    """

    device_count = staticmethod(lambda: 1)


_CPU_TORCH_ONE_DEVICE = _CpuTorch(cuda=_CpuCudaOneDevice())


def cpu_torch_one_device(original: Any, run: Any = None) -> _CpuTorch:
    """Hook 4's ``torch`` for ``megatron.training`` (see docs/megatron-cpu-notes.md for the call sites)."""
    return _CPU_TORCH_ONE_DEVICE


def allowing_no_cuda(initialize_megatron: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``initialize_megatron`` with ``allow_no_cuda=True`` (it asserts CUDA otherwise)."""

    @functools.wraps(initialize_megatron)
    def initialize_megatron_on_cpu(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return initialize_megatron_on_cpu


def warming_fused_kernels_only_in_use(set_jit_fusion_options: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``set_jit_fusion_options`` (initialize.py), which runs the fused bias-GeLU/SwiGLU and
    bias-dropout-add kernels a few times so that torch.compile builds them (about 2.5 s a rank
    on CPU, and compile workers to shut down at exit), only when one of them is in use:
    ``pretrain_gpt.py`` turns all three off on CPU (``adapt_args_to_cpu``)."""

    @functools.wraps(set_jit_fusion_options)
    def set_options_if_fused(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        flags = get_args()
        if flags.bias_gelu_fusion or flags.bias_swiglu_fusion or flags.bias_dropout_fusion:
            return set_jit_fusion_options(*args, **kwargs)
        return None

    return set_options_if_fused


def _no_cuda_arch() -> int:
    """Stand-in for ``get_device_arch_version`` (common_utils.py:502), which asks CUDA for
    device 0's compute capability; ``validate_args`` (arguments.py:1414, 1444, 1484) calls it
    for TP/CP > 1. 0 = no CUDA architecture: the pre-Blackwell branches apply."""
    return 0


def no_cuda_arch(original: Callable[[], int], run: Any = None) -> Callable[[], int]:
    return _no_cuda_arch


def enable_cpu_training_mode() -> bool:
    """:func:`enable_cpu_mode`, plus the redirects ``megatron.training``'s loop needs; idempotent.

    Hook 4: ``registry.CPU_TORCH_TRAINING_MODULES`` see :class:`_CpuTorch` (one CPU device
    per process); hook 3's pretend-CUDA window wraps ``training.get_model``; the
    ``initialize_megatron`` that ``training.pretrain`` calls gets ``allow_no_cuda=True``;
    ``arguments.get_device_arch_version`` answers 0. (A separate group from hooks 1-3:
    importing ``megatron.training`` costs seconds that Megatron-Core-only users need not pay.)
    Returns False (and touches nothing) when CUDA is available.
    """
    if not enable_cpu_mode():
        return False
    registry.install_group(registry.CPU_TRAINING)
    return True
