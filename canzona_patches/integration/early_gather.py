"""Host-group gathers issued as the buckets reduce, during backward, before the optimizer step.

Hooks (megatron-core 0.19.2):
* ``_ParamAndGradBucketGroup.start_grad_sync`` (a registry row): once a bucket group has
  dispatched its reduce-scatter asynchronously (``--overlap-grad-reduce``, in the backward
  hook of its last gradient), its listeners are told, with the handle in
  ``grad_reduce_handle``. With ``--canzona-matrices-reduce-first`` a dense bucket group
  without a matrix may be held there instead, and dispatched after the last one with a matrix
  (:class:`MatricesFirst`; ``_ParamAndGradBucketGroup.is_first_batch`` read).
* ``_ParamAndGradBucketGroup.finish_grad_sync`` (a registry row): once a bucket group's
  reduce-scatter has completed, its listeners are told. Megatron calls it in the loop that
  ends backward (``finalize_model_grads``); only with ``--ddp-reduce-scatter-with-fp32-
  accumulation`` does a later bucket group drain its predecessor earlier. A repeated call within an iteration (upstream makes it idempotent)
  tells nobody again.
* ``DistributedDataParallel.param_to_bucket_group``: which bucket group reduces a parameter.
* ``param.main_grad``: the parameter's gradient in the bucket's buffer; after the
  reduce-scatter this rank's shard of it is final (its dtype is the buffer's).
* Under Megatron-FSDP (``--use-megatron-fsdp``): the same listeners, told by its own reduce
  pipeline (:mod:`canzona_patches.integration.fsdp_gathers`).

:class:`EarlyGathers` issues a micro-group's gather (``HostGroupEngine.prestart``) as soon as
every bucket group holding one of its matrices has reduced, from views of ``main_grad``
made once. Where it is issued:

* **On CUDA, at dispatch** (during backward): on one side stream, made once, that waits for
  the reduce-scatter's handle (a stream wait, no host synchronisation); the pieces are
  packed there and the all-to-all's NCCL stream follows it. The gathers thus run on NVLink
  while backward computes and the inter-node reduce-scatters go on. When the bucket group
  finishes, the main stream waits for the side stream, so the optimizer's in-place
  unscaling and clipping of ``main_grad`` come after the packing.
* **On CPU (gloo), at finish**: a gloo handle's wait blocks the host, which would serialise
  backward with the reduce-scatter; the gathers go when Megatron's loop ends backward.
  (:attr:`EarlyGathers.at_dispatch` forces the dispatch path; the tests use it to check its
  bookkeeping on gloo, where it is exact but slower.)

Those gradients are neither unscaled nor clipped yet; the host multiplies what it receives
by the loss scale's inverse and the clip factor when the step runs, in Megatron's order,
which is bitwise what the holders' main gradients hold (a gather only copies). A skipped
step drops the staged gathers before any state is touched. The step itself then finds
those gathers in flight. What it costs: the gathers' send and receive buffers are alive
from the bucket's reduction to the step (at most every micro-group's at once, the bytes
this rank moves in the step; on CUDA this overlaps the end of backward's activations), and
no host synchronisation.

**Early compute** (:class:`EarlyCompute`, ``--canzona-early-compute``, where the run decides it:
``planning.speculation``): once a micro-group's gather is issued and backward's work is queued
(:meth:`EarlyGathers.on_finishing`, the first ``finish_grad_sync`` of the iteration; a group
gathered later, when it is issued), its host computes the group's updates on a second side
stream made once (CUDA; on gloo the host itself), leaving the optimizer state as it was
(``CanzonaOptimizer.stage_compute``: Muon's new momentum made apart, Shampoo's, SOAP's and the
adaptive Muons' staging copies of their state), speculating that the clip will not act, in the
iterations the speculation policy picks (:attr:`EarlyGathers.speculating`). The step commits them
if no factor remains to apply (Muon's momentum advancing then, from the gradients gathered
again), computes the group again if the clip acts, and a skipped step drops them
(:meth:`EarlyGathers.drop`); bitwise the step's own computation either way. Only the
micro-groups within the memory budget go early (:attr:`EarlyCompute.groups`). Costs: those
matrices' directions (and the staging copies, made once), alive from their computation to the
step; Muon's momentum pass at the commit; one event per group gathered in backward; with a loss
scaler, the main stream waits for the compute stream before Megatron unscales the gradients in
place (:meth:`EarlyGathers.settle`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary


class Told:
    """Canzona's own table, by identity, of the objects a Megatron object tells (nothing is set on
    Megatron's objects): an entry goes with its key, and a listener with its optimizer. Both are
    held weakly, so that no listener, which reaches its model through its optimizer, keeps the
    key alive (a run's model, buckets and process groups outlive it otherwise)."""

    def __init__(self) -> None:
        self._table: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def add(self, key: Any, listener: Any) -> None:
        refs = self._table.setdefault(key, [])
        if all(ref() is not listener for ref in refs):
            refs.append(weakref.ref(listener))

    def of(self, key: Any) -> list[Any]:
        """The live listeners of ``key``, in the order they were added."""
        return [listener for ref in self._table.get(key, ()) if (listener := ref()) is not None]


_LISTENERS = Told()
"""Bucket group -> the objects told ``on_dispatched(bucket_group)`` once its reduce-scatter is
dispatched asynchronously and ``on_reduced(bucket_group)`` once it has completed."""
_FINISHING = Told()
"""Bucket group -> the objects told ``on_finishing()`` before Megatron's loop that ends backward
first waits for it: every bucket group of the model chunks, so that the first call of an
iteration, whichever group it is for, marks the end of backward's work on the host."""


def listeners(group: Any) -> list[Any]:
    """The early gathers a bucket group (DDP's, or Megatron-FSDP's ``FsdpBucketGroup``) tells."""
    return _LISTENERS.of(group)


def announcing_dispatched_grads(original: Callable, run: Any) -> Callable:
    """``start_grad_sync`` that tells the bucket group's listeners when it has dispatched an
    asynchronous reduction (the handle is then in ``grad_reduce_handle``)."""

    @functools.wraps(original)
    def start_grad_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        order = _ORDER.get(self)
        if order is not None and order.hold(self, args, kwargs):
            return None
        before = self.grad_reduce_handle
        result = original(self, *args, **kwargs)
        if before is None and self.grad_reduce_handle is not None:
            for listener in _LISTENERS.of(self):
                listener.on_dispatched(self)
            if order is not None:
                order.dispatched(self)
        return result

    return start_grad_sync


def announcing_reduced_grads(original: Callable, run: Any) -> Callable:
    """``finish_grad_sync`` that tells the bucket group's listeners when it has reduced."""

    @functools.wraps(original)
    def finish_grad_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        already = bool(self.ddp_config.overlap_grad_reduce and getattr(self, "grad_reduce_finished", False))
        if not already:
            for listener in _FINISHING.of(self):
                listener.on_finishing()
        order = _ORDER.get(self)
        with order.finishing() if order is not None else contextlib.nullcontext():
            result = original(self, *args, **kwargs)
        if not already:
            for listener in _LISTENERS.of(self):
                listener.on_reduced(self)
        return result

    return finish_grad_sync


_ORDER: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Dense bucket group -> its :class:`MatricesFirst`, where ``--canzona-matrices-reduce-first`` is on."""


class MatricesFirst:
    """``--canzona-matrices-reduce-first``: the reduce-scatters of the dense bucket groups that
    hold no matrix (the output layer's, the norms') and become ready in backward before the
    last bucket group holding a matrix has dispatched are held back, and dispatched right after
    it, in the order they became ready. The matrices' gradients then reach their hosts earlier
    in the reduce-scatters' exposed tail, and their early compute runs beside what is left of
    it (the held reduce-scatters, the embedding's); the tail itself keeps its length where the
    reduce-scatters queue behind each other, as at scale.

    Every rank of the data-parallel group holds and releases the same bucket groups at the
    same point of backward (their gradients become ready in one order everywhere), so the
    collectives keep one order across the group. Each bucket group is reduced exactly as
    before: bitwise the same gradients. Costs: no bytes, no host synchronisation; a held
    group's gradients stay in its buffer until released. Only in backward of an iteration
    after the first (Megatron dispatches the first one's in its finish loop) and never inside
    that loop, where a held group is released before it is waited for."""

    def __init__(self, matrix_groups: Sequence[Any], other_groups: Sequence[Any]) -> None:
        self.matrix = frozenset(id(group) for group in matrix_groups)
        self.others = frozenset(id(group) for group in other_groups)
        self.pending = set(self.matrix)
        """Bucket groups with a matrix not dispatched yet this iteration."""
        self.held: list[tuple[Any, tuple, dict]] = []
        self.armed = True
        self.held_count = 0
        """Reduce-scatters held back so far (for tests and logs)."""

    def hold(self, bucket_group: Any, args: tuple, kwargs: dict) -> bool:
        """Whether ``bucket_group``'s dispatch now is held back (and kept for :meth:`release`)."""
        # Without --overlap-grad-reduce only the finish loop dispatches, where nothing is armed.
        if not (self.armed and self.pending and id(bucket_group) in self.others) or bucket_group.is_first_batch:
            return False
        self.held.append((bucket_group, args, kwargs))
        self.held_count += 1
        return True

    def dispatched(self, bucket_group: Any) -> None:
        """A bucket group dispatched its reduce-scatter; after the last with a matrix, the held ones go."""
        if id(bucket_group) in self.pending:
            self.pending.discard(id(bucket_group))
            if not self.pending:
                self.release()

    def release(self) -> None:
        """Dispatch every held bucket group, in the order they were held."""
        held, self.held = self.held, []
        armed, self.armed = self.armed, False
        try:
            for bucket_group, args, kwargs in held:
                bucket_group.start_grad_sync(*args, **kwargs)
        finally:
            self.armed = armed

    @contextlib.contextmanager
    def finishing(self):
        """Megatron's loop that ends backward: whatever is held goes first, nothing is held
        within it, and the next iteration starts with every matrix bucket group pending."""
        self.release()
        self.armed = False
        try:
            yield
        finally:
            self.pending = set(self.matrix)
            self.armed = True


class EarlyGathers:
    """Issues each micro-group's gather once the bucket groups it needs have reduced, and
    (:attr:`compute_early`) computes its directions there, staged.

    ``needs[k]``: the bucket groups holding a matrix of micro-group ``k``; ``raw``: this
    rank's pieces as views of the reduced gradient buffer (``(task key, lo)`` -> tensor).
    ``stream``: the CUDA side stream of the dispatch-time gathers (``None`` on CPU).
    ``early``: the inner optimizer's staged compute, with what it needs (:class:`EarlyCompute`)."""

    def __init__(self, engine: Any, raw: Mapping[tuple[str, int], torch.Tensor], needs: Sequence[set[Any]],
                 stream: Any = None, early: EarlyCompute | None = None, source: EarlySources | None = None,
                 parts: Sequence[Mapping[int, frozenset[str]]] = ()) -> None:
        self.engine, self.raw = engine, dict(raw)
        self.source = source
        """Where the holders keep Muon's momentum: what is gathered is its source, made from the
        raw pieces (:class:`EarlySources`), only in iterations that speculate."""
        self.sources: dict[int, Mapping[tuple[str, int], torch.Tensor]] = {}
        """This iteration's sources by micro-group, kept for early compute (a copy of this rank's
        pieces of the group, alive to the step; without early compute only while packed)."""
        self.parts = [dict(part) for part in parts]
        """Per micro-group, the task keys of each bucket group it needs (by ``id``): where the
        gather carries Muon's source, each bucket group's pieces are made, and their matrices'
        norms taken (``HostGroupEngine.prenorm``), as it reduces, so that what is left when the
        micro-group's last bucket group reduces is that one's share and the packing."""
        self.made: dict[int, dict[tuple[str, int], torch.Tensor]] = {}
        """Sources made so far this iteration, by micro-group (:attr:`parts`)."""
        self.made_keys: dict[int, set[str]] = {}
        """Their task keys (a rank holds pieces of some tasks only)."""
        self.sources_made = 0
        """Elements of the sources made so far this iteration (fp32 copies of this rank's pieces)."""
        self.sources_made_last = 0
        """Those of the last iteration that ended (stepped or dropped): at most the rank's matrix
        pieces, what ``tools/dry_run.py --fsdp`` predicts (``RankMemory.early_source_elements``)."""
        self.device = next(iter(self.raw.values())).device if self.raw else torch.device("cpu")
        self.keys = [frozenset(task.key for task in exchange.tasks) for exchange in engine.exchanges]
        self.needs = [frozenset(id(group) for group in groups) for groups in needs]
        self.stream = stream
        self.at_dispatch = stream is not None
        """Issue at the reduce-scatter's dispatch (CUDA), else when it finishes."""
        self.early = early
        self.compute_early = early is not None
        """Compute each gathered group's directions before the step, staged (CUDA: on a second
        side stream, once backward's work is queued)."""
        self.speculating = True
        """Whether this iteration computes early (the optimizer's speculation policy decides it
        after each step, for the next iteration)."""
        self.backward_done = False
        """Megatron's loop that ends backward has started this iteration (:meth:`on_finishing`)."""
        self.deferred: list[tuple[int, Any]] = []
        """Micro-groups gathered during backward, to be computed once it is over, each with the
        event that marks its packing on the gather stream (CUDA) or ``None``."""
        self.compute_stream = torch.cuda.Stream(device=stream.device) if self.compute_early and stream else None
        self.seen: dict[int, bool] = {}
        """Bucket groups reduced (or dispatched) this iteration -> whether their finish was told."""
        self.issued = 0
        """Gathers issued so far (for tests and logs)."""
        self.issued_at_dispatch = 0
        """Of those, issued from a reduce-scatter's dispatch, during backward."""
        self.issued_in_backward = 0
        """Of those, issued before Megatron's loop that ends backward (:meth:`on_finishing`)."""
        self.computed = 0
        """Micro-groups computed before their step so far."""
        self.computed_after_backward = 0
        """Of those, gathered during backward and computed once it was over (:meth:`on_finishing`)."""
        self.order: MatricesFirst | None = None
        """The dense bucket groups' reduce order (``--canzona-matrices-reduce-first``), if held."""
        self.groups = list({id(group): group for groups in needs for group in groups}.values())
        """Every bucket group a micro-group needs, in the order the micro-groups first name them
        (one order on every rank where ``needs`` are ordered, as
        :func:`~canzona_patches.integration.fsdp_gathers.attach_fsdp`'s are)."""

    def on_dispatched(self, bucket_group: Any) -> None:
        """A bucket group dispatched its reduce-scatter: with :attr:`at_dispatch`, wait for it
        on the side stream and issue every micro-group it completes there."""
        if not self.at_dispatch:
            return
        if id(bucket_group) in self.seen:  # dispatched again before a step: a new iteration
            self.drop()
        self.seen[id(bucket_group)] = False
        with self._side():
            bucket_group.grad_reduce_handle.wait()  # CUDA: the side stream waits, not the host
            self._prepare(bucket_group)
            self.issued_at_dispatch += self._issue_complete()

    def on_reduced(self, bucket_group: Any) -> None:
        """A bucket group has reduced: issue every micro-group now complete, in index order
        (the same order on every rank, as all reduce their bucket groups in one order)."""
        told = self.seen.get(id(bucket_group))
        if told is False:  # dispatched this iteration: its gathers went then
            self.seen[id(bucket_group)] = True
            if self.stream is not None:  # main_grad is unscaled and clipped in place after the packing
                torch.cuda.current_stream().wait_stream(self.stream)
            return
        if told:  # reported again before a step: a new iteration
            self.drop()
        self.seen[id(bucket_group)] = True
        self._prepare(bucket_group)
        self._issue_complete()

    def on_fsdp_reduce(self, group: Any) -> None:
        """Megatron-FSDP: ``group``'s last reduce-scatter is dispatched (CUDA: wait for its event
        on the side stream and issue there) or done (gloo: issue now)."""
        if self.at_dispatch and group.grad_reduce_handle is not None:
            self.on_dispatched(group)
        else:
            self.on_reduced(group)

    def on_fsdp_finished(self) -> None:
        """Megatron-FSDP's ``finish_grad_sync`` has waited for every reduce-scatter: the bucket
        groups whose gathers went on the side stream are settled (the main stream waits for it
        before the optimizer scales the gradients in place), those not reported yet are
        gathered now, in one order on every rank."""
        for group in self.groups:
            if self.seen.get(id(group)) is not True:
                self.on_reduced(group)

    def on_finishing(self) -> None:
        """Megatron's loop that ends backward is about to wait for the first bucket group of the
        iteration: backward's kernels are all queued. The groups gathered during backward are
        computed now, in the reduce-scatters' tail, not beside backward's GEMMs (on CUDA the
        compute stream waits for the main stream here, so they also run after backward on the
        device)."""
        if self.backward_done:
            return
        self.backward_done = True
        deferred, self.deferred = self.deferred, []
        for k, packed in deferred:
            self._precompute(k, packed)
        self.computed_after_backward += len(deferred)

    @property
    def norms_ahead(self) -> int:
        """Matrices whose norm was taken as their bucket group reduced, so far (:meth:`_prepare`)."""
        return self.engine.norms_ahead

    @property
    def norms_at_gather(self) -> int:
        """Matrices whose norm their micro-group's gather took itself, so far (early or in the step)."""
        return self.engine.norms_at_gather

    def _prepare(self, bucket_group: Any) -> None:
        """Where the gathers carry Muon's source and this iteration speculates: make the sources
        of ``bucket_group``'s pieces of every micro-group not yet gathered and take their
        matrices' norms (collectives: every rank's bucket groups reduce in one order)."""
        if self.source is None or not self.speculating:
            return
        for k, parts in enumerate(self.parts):
            keys = parts.get(id(bucket_group))
            if not keys or k in self.engine.staged or keys <= self.made_keys.get(k, set()):
                continue
            made = self.source.make(keys, self.raw, self.source.scale())
            self.sources_made += sum(piece.numel() for piece in made.values())
            self.made.setdefault(k, {}).update(made)
            self.made_keys.setdefault(k, set()).update(keys)
            self.engine.prenorm(k, keys, lambda key, lo, made=made: made[(key, lo)], self.device)

    def _issue_complete(self) -> int:
        reduced = frozenset(self.seen)
        count = 0
        for k, needs in enumerate(self.needs):
            if k not in self.engine.staged and needs <= reduced:
                if self.source is None:
                    self.engine.prestart(k, self.raw)
                elif not self.speculating:
                    continue  # the step gathers its source, with whatever clip it decides
                else:
                    scale = self.source.scale()
                    sources = self.made.pop(k, {})
                    rest = self.keys[k] - self.made_keys.pop(k, set())
                    if rest:
                        late = self.source.make(rest, self.raw, scale)
                        self.sources_made += sum(piece.numel() for piece in late.values())
                        sources.update(late)
                    self.engine.prestart(k, sources, speculative=True, scaled=len(scale))
                    if self.compute_early:  # its host's own pieces, for the early compute
                        self.sources[k] = sources
                count += 1
                if self.compute_early and self.speculating and self.engine.exchanges[k].index in self.early.groups:
                    if self.at_dispatch and not self.backward_done:
                        self.deferred.append((k, self._packed()))
                    else:
                        self._precompute(k)
        self.issued += count
        if not self.backward_done:
            self.issued_in_backward += count
        return count

    def _packed(self) -> Any:
        """An event after the packing just queued on the gather stream (CUDA), else ``None``."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _precompute(self, k: int, packed: Any = None) -> None:
        """Micro-group ``k``'s directions, staged; on CUDA on the compute stream, after what the
        current stream has queued (the gather stream's packing, or at the end of backward the
        main stream's work) and ``packed`` (the gather's own wait is a stream wait there too)."""
        assert self.early is not None
        raw, scale = (self.sources[k], ()) if k in self.sources else (self.raw, self.early.scale())
        if self.compute_stream is None:
            self.engine.precompute(k, raw, self.early.compute, scale)
        else:
            self.compute_stream.wait_stream(torch.cuda.current_stream(self.compute_stream.device))
            if packed is not None:
                self.compute_stream.wait_event(packed)
            with torch.cuda.stream(self.compute_stream):
                self.engine.precompute(k, raw, self.early.compute, scale)
        self.computed += 1

    def settle(self) -> None:
        """Before the main stream changes the gradients in place (unscaling by the loss scale):
        it waits for what the compute stream still reads of them (CUDA; a stream wait)."""
        if self.compute_stream is not None:
            torch.cuda.current_stream(self.compute_stream.device).wait_stream(self.compute_stream)

    def _side(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def drop(self) -> None:
        """Forget this iteration's gathers and early results (a skipped step, or an iteration
        without one); the optimizer state stays as it was."""
        self.engine.drop_staged()
        if self.early is not None:
            self.early.discard()
        self._new_iteration()

    def stepped(self) -> None:
        """The step consumed the gathers; the next iteration starts afresh."""
        self._new_iteration()

    def _new_iteration(self) -> None:
        self.sources_made_last, self.sources_made = self.sources_made, 0
        self.seen.clear()
        self.sources.clear()
        self.made.clear()
        self.made_keys.clear()
        self.deferred.clear()
        self.backward_done = False


@dataclass(frozen=True)
class EarlySources:
    """Where the holders keep Muon's momentum (Megatron-FSDP): the gather carries its source, so
    a micro-group is gathered before the step only speculating that no clip acts (its source is
    the step's own then; else the step gathers it again: ``HostGroupEngine.prestart``'s
    ``speculative``), in the iterations the speculation policy picks."""

    make: Callable[[frozenset[str], Mapping[tuple[str, int], torch.Tensor], tuple[Any, ...]],
                   Mapping[tuple[str, int], torch.Tensor]]
    """The inner optimizer's ``speculative_sources``: this rank's pieces of some tasks, made
    from the raw ones and the factors known before the step."""
    scale: Callable[[], tuple[Any, ...]]
    """Those factors (the loss scale's inverse, or none)."""


@dataclass(frozen=True)
class EarlyCompute:
    """What the early gathers need to compute a micro-group before the step, staged."""

    compute: Callable[[Sequence[str], Sequence[torch.Tensor]], Sequence[torch.Tensor]]
    """The inner optimizer's host compute leaving its state as it was (``stage_compute``)."""
    discard: Callable[[], None]
    """Drops the staged updates (a skipped step)."""
    scale: Callable[[], tuple[Any, ...]]
    """The factors known before the step (the loss scale's inverse, or none)."""
    groups: frozenset[int] = frozenset()
    """The micro-groups (by index) this rank computes early, within the memory budget
    (:func:`~megatron.canzona.planning.memory.early_compute_groups`); the others in the step."""


def gathers_apply(engine: Any, binding: Any, compute: EarlyCompute | None) -> bool:
    """Whether an optimizer has early gathers: async mode, something to move or to compute early,
    and no matrix clipped by its own group's norm (its factor is not the one the step keeps)."""
    if engine.mode != "async" or not engine.exchanges:
        return False
    if compute is None and not any(exchange.moves for exchange in engine.exchanges):
        return False
    from megatron.core.optimizer.optimizer import GRAD_NORM_GROUP_ATTR

    return not any(getattr(param, GRAD_NORM_GROUP_ATTR, None) is not None for param in binding.params.values())


def listen(engine: Any, raw: dict[tuple[str, int], torch.Tensor], needs: Sequence[Any], first: Any,
           compute: EarlyCompute | None, source: EarlySources | None = None,
           parts: Sequence[Mapping[int, frozenset[str]]] = ()) -> EarlyGathers:
    """The early gathers over ``raw`` (on a side stream of ``first``'s device, made once, on
    CUDA), told by every bucket group in ``needs`` (``parts``: :attr:`EarlyGathers.parts`); the
    registry rows that tell them installed."""
    from canzona_patches import registry

    registry.install_group(registry.EARLY_GATHER)
    stream = torch.cuda.Stream(device=first.device) if first is not None and first.is_cuda else None
    early = EarlyGathers(engine, raw, needs, stream=stream, early=compute, source=source, parts=parts)
    for groups in needs:
        for group in groups:
            _LISTENERS.add(group, early)
    return early


def attach(engine: Any, binding: Any, model_chunks: Sequence[Any], compute: EarlyCompute | None = None,
           matrices_first: bool = False) -> EarlyGathers | None:
    """Early gathers for one Canzona DistributedOptimizer (its host-group ``engine``, in async
    mode, and its ``binding``): its listener on every bucket group holding one of its matrices.
    ``None`` when nothing moves and nothing is to be computed early (``compute``).
    ``matrices_first``: with early compute, the dense bucket groups without a matrix reduce
    after the last one with a matrix (:class:`MatricesFirst`; the dense optimizer's only)."""
    if not gathers_apply(engine, binding, compute):
        return None
    group_of: dict[torch.nn.Parameter, Any] = {}
    for chunk in model_chunks:
        group_of.update(chunk.param_to_bucket_group)
    raw: dict[tuple[str, int], torch.Tensor] = {}
    for shard, refs in binding.pieces.items():
        model_param = binding.shard_params[shard]
        flat = model_param.main_grad.view(-1)
        start = binding.shard_starts[shard]
        for ref in refs:
            raw[(ref.key, ref.lo)] = flat[start + ref.offset : start + ref.offset + ref.hi - ref.lo]
    needs: list[set[Any]] = []
    for exchange in engine.exchanges:
        needs.append({group_of[binding.params[task.key]] for task in exchange.tasks})
    early = listen(engine, raw, needs, next(iter(raw.values()), None), compute)
    if early.compute_early:
        for chunk in model_chunks:
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                _FINISHING.add(group, early)
    if matrices_first and early.compute_early:
        early.order = order_matrices_first(model_chunks, set().union(*needs))
    return early


def order_matrices_first(model_chunks: Sequence[Any], matrix_groups: set[Any]) -> MatricesFirst | None:
    """A :class:`MatricesFirst` over the dense bucket groups of ``model_chunks`` (those reduced
    over the data-parallel group; ``None`` if ``matrix_groups`` are not among them, as the
    experts' are not, or no other dense bucket group is there to hold)."""
    dense = [group for chunk in model_chunks for group in chunk.bucket_groups]
    ids = {id(group) for group in dense}
    if not matrix_groups or any(id(group) not in ids for group in matrix_groups):
        return None
    others = [group for group in dense if group not in matrix_groups]
    if not others:
        return None
    order = MatricesFirst(list(matrix_groups), others)
    for group in dense:
        _ORDER[group] = order
    return order
