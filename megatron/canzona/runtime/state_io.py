"""Canzona optimizer state as name-keyed global tensors, the form its checkpoints store.

A checkpoint must load at another data- or tensor-parallel size, so nothing in it may
depend on which rank held what. Every tensor the Canzona optimizer keeps is therefore
described as a piece (a *chunk*) of a global tensor named after its parameter:

* **matrix state** (Muon momentum, Shampoo statistics and roots, SOAP moments and bases)
  lives whole on the one rank that computes the matrix, at full (tensor-parallel global)
  size, one chunk per piece and field: ``<name>.piece<i>.<field>``, plus ``<name>.step``
  (one int64 per piece: the step counters, which also fix the preconditioner refresh phase);
* **elementwise state** (AdamW moments) and the **fp32 main parameters** are flat slices of
  a rank's data-parallel shard of its (tensor-parallel local) parameter. They are stored in
  model space: the slice becomes a few boxes of the parameter's global shape
  (``<name>.exp_avg``, ``<name>.exp_avg_sq``, ``<name>.main_param``), and its AdamW step
  counter is ``<name>.step`` with shape ``(1,)``.

A :class:`StateChunk` says where its values sit in the global tensor, whether this rank is
the one that writes them (``main``), and how loaded values go back into the live state.
The checkpoint format around it (Megatron's ``ShardedTensor``) is the business of
``canzona_patches.checkpoints.state``; this module only knows tensors and state dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offset, size)`` of a rectangular block of an N-D tensor."""


@dataclass(frozen=True, kw_only=True)
class StateChunk:
    """One rank's block of one global state tensor."""

    key: str
    """Name of the global tensor (``<prefix><param name>.<field>``)."""
    data: torch.Tensor
    """The block's values, shaped like the block (a view of live state where possible)."""
    global_shape: tuple[int, ...]
    """Shape of the whole global tensor."""
    global_offset: tuple[int, ...]
    """Where the block starts in the global tensor."""
    main: bool
    """This rank writes the block; every element of a global tensor has exactly one writer."""
    restore: Callable[[torch.Tensor], None]
    """Puts loaded values (shaped like ``data``) back into the optimizer's live state."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a rank's flat shard of a parameter sits in the parameter's global tensor."""

    local_shape: tuple[int, ...]
    """Shape of this tensor-parallel rank's parameter."""
    flat_start: int
    """First element of the shard in the flattened local parameter."""
    flat_end: int
    """One past the last element of the shard."""
    tp_dim: int | None = None
    """Dimension split across tensor-parallel ranks; ``None`` when every TP rank holds it whole."""
    tp_stride: int = 1
    """Blocks per local shard along ``tp_dim`` (Megatron's ``partition_stride``): local block
    j is this rank's piece of global block j (2 for a fused SwiGLU fc1)."""
    tp_rank: int = 0
    """This rank's index in its tensor-parallel group."""
    tp_size: int = 1
    """Tensor-parallel group size."""

    def __post_init__(self) -> None:
        numel = prod(self.local_shape)
        if not 0 <= self.flat_start <= self.flat_end <= numel:
            raise ValueError(f"flat range [{self.flat_start}, {self.flat_end}) outside a {numel}-element parameter")
        if self.tp_dim is not None:
            if not 0 <= self.tp_dim < len(self.local_shape):
                raise ValueError(f"tp_dim {self.tp_dim} is not a dimension of shape {self.local_shape}")
            if self.tp_stride < 1 or self.local_shape[self.tp_dim] % self.tp_stride:
                raise ValueError(f"tp_stride {self.tp_stride} does not divide dim {self.tp_dim} of {self.local_shape}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside a TP group of {self.tp_size}")

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Shape of the whole (tensor-parallel global) parameter."""
        if self.tp_dim is None:
            return self.local_shape
        shape = list(self.local_shape)
        shape[self.tp_dim] *= self.tp_size
        return tuple(shape)

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes what it holds: a TP-replicated parameter is written by TP rank 0."""
        return self.tp_dim is not None or self.tp_rank == 0


# --------------------------------------------------------------------------- geometry


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Cover elements ``[start, end)`` of a row-major tensor of ``shape`` with boxes.

    Each box is a contiguous run of the flattened tensor (fixed leading indices, one ranged
    axis, whole trailing axes), so ``flat[a:b].view(size)`` is its data. At most
    ``2 * ndim - 1`` boxes."""
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= end <= prod(shape):
        raise ValueError(f"range [{start}, {end}) outside a tensor of shape {shape}")
    if not shape:
        return [((), ())] if end > start else []
    boxes: list[Box] = []
    _cover(shape, start, end, (), boxes)
    return boxes


def _cover(shape: tuple[int, ...], start: int, end: int, prefix: tuple[int, ...], out: list[Box]) -> None:
    if start >= end:
        return
    inner = prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    whole_from = first if start % inner == 0 else first + 1
    whole_to = last + 1 if end % inner == 0 else last  # exclusive
    if whole_from >= whole_to:  # no whole slab: the range lies in one or two partial slabs
        if first == last:
            _cover(shape[1:], start - first * inner, end - first * inner, prefix + (first,), out)
            return
        _cover(shape[1:], start - first * inner, inner, prefix + (first,), out)
        _cover(shape[1:], 0, end - last * inner, prefix + (last,), out)
        return
    if whole_from > first:
        _cover(shape[1:], start - first * inner, inner, prefix + (first,), out)
    offset = prefix + (whole_from,) + (0,) * (len(shape) - 1)
    size = (1,) * len(prefix) + (whole_to - whole_from,) + shape[1:]
    out.append((offset, size))
    if whole_to <= last:
        _cover(shape[1:], 0, end - last * inner, prefix + (last,), out)


def to_global_boxes(box: Box, placement: Placement) -> list[tuple[Box, Box]]:
    """``(local box, global box)`` pairs for one box of the local parameter.

    Without tensor parallelism (or for a TP-replicated parameter) the global box is the
    local one. Along ``tp_dim`` local block j of a strided shard lands in global block j,
    so a box crossing local blocks is cut at their boundaries."""
    offset, size = box
    dim = placement.tp_dim
    if dim is None or placement.tp_size == 1:
        return [(box, box)]
    local_len = placement.local_shape[dim]
    block = local_len // placement.tp_stride
    global_block = block * placement.tp_size
    pairs = []
    position, stop = offset[dim], offset[dim] + size[dim]
    while position < stop:
        j = position // block
        piece_end = min(stop, (j + 1) * block)
        local_offset = offset[:dim] + (position,) + offset[dim + 1 :]
        piece_size = size[:dim] + (piece_end - position,) + size[dim + 1 :]
        global_start = j * global_block + placement.tp_rank * block + (position - j * block)
        global_offset = offset[:dim] + (global_start,) + offset[dim + 1 :]
        pairs.append(((local_offset, piece_size), (global_offset, piece_size)))
        position = piece_end
    return pairs


def _local_view(flat: torch.Tensor, placement: Placement, box: Box) -> torch.Tensor:
    """The block ``box`` of the local parameter, as a view of the rank's flat shard (which
    starts at element ``placement.flat_start`` of the flattened parameter)."""
    shape = placement.local_shape
    strides = [prod(shape[i + 1 :]) for i in range(len(shape))]
    offset, size = box
    first = sum(o * s for o, s in zip(offset, strides)) - placement.flat_start
    return flat.as_strided(size, strides, flat.storage_offset() + first)


# --------------------------------------------------------------------------- chunks


def _copy_into(target: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def restore(values: torch.Tensor) -> None:
        if values.data_ptr() == target.data_ptr() and values.shape == target.shape and values.dtype == target.dtype:
            return  # the loader read straight into the live tensor
        target.copy_(values.to(device=target.device, dtype=target.dtype).view(target.shape))

    return restore


def flat_chunks(key: str, flat: torch.Tensor, placement: Placement) -> list[StateChunk]:
    """Chunks of a tensor shaped like the rank's flat shard (an AdamW moment, a main param)."""
    if flat.dim() != 1 or flat.numel() != placement.flat_end - placement.flat_start:
        raise ValueError(
            f"{key}: a flat shard of {placement.flat_end - placement.flat_start} elements was expected, "
            f"got shape {tuple(flat.shape)}"
        )
    if not flat.is_contiguous():
        raise ValueError(f"{key}: the flat shard must be contiguous")
    chunks = []
    for box in flat_range_boxes(placement.local_shape, placement.flat_start, placement.flat_end):
        for local_box, (global_offset, size) in to_global_boxes(box, placement):
            view = _local_view(flat, placement, local_box)
            chunks.append(StateChunk(
                key=key, data=view, global_shape=placement.global_shape, global_offset=global_offset,
                main=placement.is_writer, restore=_copy_into(view),
            ))
    return chunks


def elementwise_chunks(prefix: str, name: str, state: dict, placement: Placement) -> list[StateChunk]:
    """Chunks of one parameter's AdamW state (``{"step": int, "exp_avg": t, ...}``; moments
    shaped like the rank's shard, flat or in whole rows as Megatron-FSDP's shards are)."""
    chunks = []
    for field, value in sorted(state.items()):
        if isinstance(value, torch.Tensor):
            chunks.extend(flat_chunks(f"{prefix}{name}.{field}", value.view(-1), placement))
    # One writer for the whole parameter's counter: TP rank 0's shard holding element 0.
    chunks.append(_step_chunk(f"{prefix}{name}.step", [state], main=placement.tp_rank == 0 and placement.flat_start == 0))
    return chunks


def matrix_chunks(prefix: str, name: str, state: dict, *, main: bool, first_piece: int = 0,
                  pieces: int | None = None) -> list[StateChunk]:
    """Chunks of one matrix's state (``{"pieces": [piece state, ...]}``), all whole. A part
    of a matrix hosted apart holds pieces ``first_piece, ...`` of the matrix's ``pieces``
    (its state tensors are named as if one host held them all)."""
    states = state.get("pieces")
    if not states:
        raise ValueError(f"{name}: matrix state has no pieces; create it (init_state) before saving or loading")
    total = len(states) if pieces is None else pieces
    if first_piece < 0 or first_piece + len(states) > total:
        raise ValueError(f"{name}: pieces {first_piece}..{first_piece + len(states) - 1} outside the matrix's {total}")
    chunks = []
    for index, piece in enumerate(states, start=first_piece):
        for field, value in sorted(piece.items()):
            if isinstance(value, torch.Tensor):
                chunks.append(StateChunk(
                    key=f"{prefix}{name}.piece{index}.{field}", data=value, global_shape=tuple(value.shape),
                    global_offset=(0,) * value.dim(), main=main, restore=_copy_into(value),
                ))
    chunks.append(_step_chunk(f"{prefix}{name}.step", states, main=main, offset=first_piece, total=total))
    return chunks


def _step_chunk(key: str, states: list[dict], *, main: bool, offset: int = 0, total: int | None = None) -> StateChunk:
    """The step counters of ``states`` as one int64 tensor (restored as Python ints): elements
    ``offset, ...`` of a global tensor of ``total`` counters."""
    steps = torch.tensor([int(s.get("step", 0)) for s in states], dtype=torch.int64)

    def restore(values: torch.Tensor) -> None:
        loaded = [int(v) for v in values.reshape(-1).tolist()]
        if len(loaded) != len(states):
            raise ValueError(f"{key}: the checkpoint has {len(loaded)} step counters, this run needs {len(states)}")
        for state, step in zip(states, loaded):
            state["step"] = step

    return StateChunk(
        key=key, data=steps, global_shape=(len(states) if total is None else total,), global_offset=(offset,),
        main=main, restore=restore,
    )
