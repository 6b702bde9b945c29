"""Train/valid/test GPT datasets as Megatron's pretrain_gpt builds them.

The data come from one indexed dataset, a weighted blend of several (every split cut from
each by ``split``), one blend per split, or Megatron's mock generator; Megatron-Core's
``BlendedMegatronDatasetBuilder`` builds them all. Before it runs, :func:`check_gpt_data`
turns the inputs that would crash or hang it into one-line errors naming the fix.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron.canzona.data.helpers import ensure_dataset_helpers

Blend = tuple[list[str], list[float] | None]
"""Megatron's blend: dataset prefixes and their weights (None: in proportion to their sizes)."""

SPLIT_NAMES = ("train", "validation", "test")
_PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


@dataclass(frozen=True, kw_only=True)
class GPTDataConfig:
    """Where the tokens are and how to cut them into samples (give exactly one source)."""

    seq_length: int
    """Tokens per sample (Megatron reads one more for the shifted labels)."""
    data_prefix: str | None = None
    """One indexed dataset prefix (``.bin``/``.idx`` without suffix): short for ``blend=([prefix], None)``."""
    blend: Blend | None = None
    """Datasets every split is drawn from, each cut by ``split``, as Megatron's ``--data-path [W] P ...``."""
    blend_per_split: Sequence[Blend | None] | None = None
    """Train, valid and test blends (None: no such split), as ``--train/valid/test-data-path``."""
    mock: bool = False
    """Megatron's synthetic tokens instead of files, as ``--mock-data``."""
    split: str | None = "949,50,1"
    """Train,valid,test weights over each dataset's documents, as ``--split`` (unused per split or mock)."""
    seed: int = 1234
    """Shuffling seed, as Megatron's ``--seed``."""
    cache_dir: str | None = None
    """Where the sample indices are cached; None puts them in ``<data dir>/cache``."""
    eod_mask_loss: bool = False
    """Mask the loss on end-of-document tokens, as Megatron's ``--eod-mask-loss``."""
    create_attention_mask: bool = True
    """Give each sample its causal ``[1, s, s]`` mask; False (Megatron's
    ``--no-create-attention-mask-in-dataloader``) leaves it to the attention kernels."""
    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token, as ``--reset-position-ids``."""
    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens, as ``--reset-attention-mask``."""
    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built per blended dataset, as ``--mid-level-dataset-surplus``."""
    num_builder_threads: int = 1
    """Threads building a blend's datasets, as ``--num-dataset-builder-threads``."""

    def resolved_blend(self) -> Blend | None:
        """The blend every split is drawn from (``data_prefix`` as a blend of one), or None."""
        if self.data_prefix is not None:
            return [self.data_prefix], None
        return self.blend


def build_gpt_datasets(config: GPTDataConfig, tokenizer: Any, num_samples: Sequence[int | None]) -> list[Any]:
    """Build ``[train, valid, test]`` with ``BlendedMegatronDatasetBuilder`` (None for a split with no data).

    ``num_samples`` is the number of samples wanted from each split; a dataset with fewer
    tokens is cycled over more epochs, as in Megatron. A split drawn from several datasets is
    a ``BlendedDataset`` over one ``GPTDataset`` per prefix.
    """
    check_gpt_data(config)
    ensure_dataset_helpers()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    dataset_config = GPTDatasetConfig(
        random_seed=config.seed,
        sequence_length=config.seq_length,
        # Neither given means mock data to Megatron.
        blend=None if config.mock else config.resolved_blend(),
        blend_per_split=None if config.mock or config.blend_per_split is None else list(config.blend_per_split),
        split=None if config.mock or config.blend_per_split is not None else config.split,
        num_dataset_builder_threads=config.num_builder_threads,
        path_to_cache=config.cache_dir,
        tokenizer=tokenizer,
        mid_level_dataset_surplus=config.mid_level_dataset_surplus,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=config.create_attention_mask,
    )
    dataset_class = MockGPTDataset if config.mock else GPTDataset
    # Every caller holds data (pretrain_gpt's is_dataset_built_on_rank is true on all ranks
    # without pipeline parallelism); with torch.distributed up, rank 0 builds first.
    return BlendedMegatronDatasetBuilder(dataset_class, list(num_samples), lambda: True, dataset_config).build()


def check_gpt_data(config: GPTDataConfig) -> None:
    """Raise ``ValueError`` naming the fix for a config Megatron's builder would crash or hang on.

    One source given; every prefix's ``.bin``/``.idx`` present; blend weights positive and one
    per prefix; and no split of any prefix without tokens: Megatron-Core 0.19.2's
    ``GPTDataset._get_num_epochs`` (gpt_dataset.py:676) loops forever for a split of zero
    tokens, so a small corpus with ``--split 949,50,1`` would hang there.
    """
    if config.seq_length < 1:
        raise ValueError(f"seq_length must be 1 or more, got {config.seq_length}")
    _check_one_source(config)
    if config.blend_per_split is not None:
        _check_per_split(config.blend_per_split)
    elif not config.mock:
        _check_split_of_blend(config.resolved_blend(), config.split)


def check_blend_words(words: Sequence[str] | None, flag: str) -> None:
    """A data flag's words as given (``--data-path``, ``--train-data-path``, ...): prefixes
    alone, or weight-prefix pairs (``0.3 A 0.7 B``). Megatron reads an odd-numbered list as
    prefixes and fails later on a file named after a weight; raise ``ValueError`` here instead."""
    if not words or len(words) == 1 or not any(_is_number(w) for w in words):
        return
    weights, prefixes = words[0::2], words[1::2]
    if len(words) % 2 or not all(_is_number(w) for w in weights) or any(_is_number(p) for p in prefixes):
        raise ValueError(
            f"{flag} {' '.join(words)}: a blend is weight-prefix pairs (e.g. {flag} 0.3 data/a_text_document "
            "0.7 data/b_text_document) or prefixes alone")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_per_split(blend_per_split: Sequence[Blend | None]) -> None:
    """Each split's datasets are used whole, so each must hold tokens."""
    if len(blend_per_split) != len(SPLIT_NAMES):
        raise ValueError(f"blend_per_split needs one blend (or None) per split, got {len(blend_per_split)}")
    for flag, name, blend in zip(_PER_SPLIT_FLAGS, SPLIT_NAMES, blend_per_split):
        if blend is None:
            continue
        _check_blend(blend, flag)
        for prefix in blend[0]:
            if (num_documents := _documents_if_empty(prefix, (0.0, 1.0))) is not None:
                raise ValueError(
                    f"{flag} {prefix} holds no tokens ({num_documents} documents), which hangs "
                    f"Megatron's GPTDataset as the {name} split: give a dataset with documents")


def _check_split_of_blend(blend: Blend, split: str | None) -> None:
    """``split`` cuts every dataset of the blend alike, so each of its parts must hold tokens."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    _check_blend(blend, "--data-path")
    if split is None:
        raise ValueError("--data-path needs --split (train,valid,test weights, e.g. 949,50,1)")
    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for prefix in blend[0]:
        for name, bound in zip(SPLIT_NAMES, bounds):
            if bound is not None and (num_documents := _documents_if_empty(prefix, bound)) is not None:
                raise ValueError(
                    f"--split {split} leaves the {name} split of {prefix} ({num_documents} documents) "
                    "empty, which hangs Megatron's GPTDataset: give it a larger weight or weight 0")


def _check_one_source(config: GPTDataConfig) -> None:
    per_split = config.blend_per_split is not None and any(b is not None for b in config.blend_per_split)
    given = [config.data_prefix is not None, config.blend is not None, per_split, config.mock]
    if sum(given) == 1:
        return
    if sum(given) == 0:
        raise ValueError("no data given: pass --data-path (or --data-args-path), --train-data-path/"
                         "--valid-data-path/--test-data-path, or --mock-data")
    raise ValueError("give one data source: --data-path (or --data-args-path), --train-data-path/"
                     "--valid-data-path/--test-data-path, or --mock-data, not several")


def _check_blend(blend: Blend, flag: str) -> None:
    prefixes, weights = blend
    if not prefixes:
        raise ValueError(f"{flag} names no dataset: pass a prefix, or weights and prefixes (e.g. 0.3 A 0.7 B)")
    if weights is not None:
        if len(weights) != len(prefixes):
            raise ValueError(f"{flag} has {len(weights)} weights for {len(prefixes)} datasets: give one per prefix")
        if any(not weight > 0 for weight in weights):
            raise ValueError(f"{flag} weights must be positive, got {weights}: leave a dataset out instead of weight 0")
    for prefix in prefixes:
        _check_files(prefix)


def _check_files(prefix: str) -> None:
    if _is_object_storage(prefix):
        return
    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise ValueError(
                f"{prefix}{suffix} not found: pass the prefix without .bin/.idx "
                "as written by tools/preprocess_data.py (e.g. data/demo/demo_text_document)"
            )
    _check_bin_size(prefix)


INDEX_MAGIC = b"MMIDIDX\x00\x00"
"""The first bytes of a Megatron indexed dataset's ``.idx``."""
INDEX_HEADER = struct.Struct("<QBQQ")
"""After the magic: version, token dtype code, sequence count, document count."""
TOKEN_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
"""Megatron's dtype codes (``indexed_dataset.DType``) -> bytes per token."""
REBUILD = "rebuild the pair with tools/preprocess_data.py (or copy both files again)"


def _check_index(prefix: str) -> None:
    """The ``.idx`` is whole: its header, and the arrays its counts announce (lengths, pointers,
    document indices). Megatron's reader would fail on a cut or foreign file with numpy's "buffer
    is smaller than requested size", naming no file, and a second error from its ``__del__``."""
    path = Path(prefix + ".idx")
    size = path.stat().st_size
    with open(path, "rb") as stream:
        head = stream.read(len(INDEX_MAGIC) + INDEX_HEADER.size)
    if len(head) < len(INDEX_MAGIC) + INDEX_HEADER.size or not head.startswith(INDEX_MAGIC):
        raise ValueError(f"{path} is not a Megatron dataset index (its first bytes are not {INDEX_MAGIC!r}): "
                         f"{REBUILD}")
    _, code, sequences, documents = INDEX_HEADER.unpack(head[len(INDEX_MAGIC):])
    if code not in TOKEN_BYTES:
        raise ValueError(f"{path} names token type code {code}, which no Megatron dataset uses: {REBUILD}")
    needed = len(head) + 4 * sequences + 8 * sequences + 8 * documents
    if size < needed:
        raise ValueError(f"{path} holds {size} bytes, its header announces {sequences} sequences and {documents} "
                         f"documents ({needed} bytes): the file is truncated or damaged; {REBUILD}")


def _check_bin_size(prefix: str) -> None:
    """The ``.bin`` holds every token its ``.idx`` points at: a truncated file (a copy cut short)
    would otherwise pass and fail at iteration 1 with numpy's "offset must be non-negative"."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    _check_index(prefix)
    size = Path(prefix + ".bin").stat().st_size
    if size == 0:
        return  # an empty dataset: the split checks name it
    index = IndexedDataset(prefix).index  # reads the .idx; the .bin is only mapped
    if not index.sequence_count:
        return
    needed = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
    if size < needed:
        raise ValueError(
            f"{prefix}.bin holds {size} bytes, its index {prefix}.idx points to {needed}: the file is truncated; "
            "copy it again or rewrite it with tools/preprocess_data.py")
    if size > needed:
        raise ValueError(
            f"{prefix}.bin holds {size} bytes, its index {prefix}.idx ends its last document at byte {needed}: the "
            f"two files are not one pair (another dataset's .bin or .idx?); {REBUILD}")


def _documents_if_empty(prefix: str, bound: tuple[float, float]) -> int | None:
    """``prefix``'s number of documents if those in ``bound`` hold no token, else None.

    The documents of a split are cut as ``BlendedMegatronDatasetBuilder`` cuts them: by rounding
    the bound times the number of sequences (one per document in a GPT dataset).
    """
    if _is_object_storage(prefix):
        return None
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if Path(prefix + ".bin").stat().st_size == 0:
        return 0  # nothing to read (and an empty file cannot be mapped)
    dataset = IndexedDataset(prefix)  # held while its lengths are read: deleting it closes their mmap
    num_sequences = dataset.sequence_lengths.shape[0]
    begin, end = (int(round(b * float(num_sequences))) for b in bound)
    num_tokens = int(np.sum(dataset.sequence_lengths[begin:end], dtype=np.int64)) if end > begin else 0
    del dataset
    return None if num_tokens > 0 else num_sequences


def _is_object_storage(prefix: str) -> bool:
    from megatron.core.datasets.object_storage_utils import is_object_storage_path

    return bool(is_object_storage_path(prefix))


def describe_datasets(datasets: Sequence[Any]) -> list[str]:
    """One line per split: its samples and where they come from (per dataset of a blend)."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    lines = []
    for name, dataset in zip(SPLIT_NAMES, datasets):
        if dataset is None:
            lines.append(f"{name}: none")
        elif isinstance(dataset, BlendedDataset):
            counts = np.bincount(dataset.dataset_index, minlength=len(dataset.datasets))
            total = float(sum(dataset.weights))
            parts = [f"{int(count)} from {part.dataset_path} (weight {weight / total:.3f})"
                     for count, part, weight in zip(counts, dataset.datasets, dataset.weights)]
            lines.append(f"{name}: {len(dataset)} samples, blend of {len(parts)}: {', '.join(parts)}")
        elif dataset.dataset_path is None:
            lines.append(f"{name}: {len(dataset)} mock samples")
        else:
            lines.append(f"{name}: {len(dataset)} samples from {dataset.dataset_path}")
    return lines
