"""Train/valid/test ``GPTDataset`` splits from one indexed dataset, as Megatron's pretrain_gpt builds them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.canzona.data.helpers import ensure_dataset_helpers


@dataclass(frozen=True, kw_only=True)
class GPTDataConfig:
    """Where the tokens are and how to cut them into samples."""

    data_prefix: str
    """Indexed dataset prefix (``.bin``/``.idx`` without suffix), as Megatron's ``--data-path``."""
    seq_length: int
    """Tokens per sample (Megatron reads one more for the shifted labels)."""
    split: str = "949,50,1"
    """Train,valid,test weights over documents, as Megatron's ``--split``."""
    seed: int = 1234
    """Shuffling seed, as Megatron's ``--seed``."""
    cache_dir: str | None = None
    """Where the sample indices are cached; None puts them in ``<data dir>/cache``."""
    eod_mask_loss: bool = False
    """Mask the loss on end-of-document tokens, as Megatron's ``--eod-mask-loss``."""
    create_attention_mask: bool = True
    """Give each sample its causal ``[1, s, s]`` mask; False (Megatron's
    ``--no-create-attention-mask-in-dataloader``) leaves it to the attention kernels."""


def build_gpt_datasets(config: GPTDataConfig, tokenizer: Any, num_samples: tuple[int, int, int]) -> list[Any]:
    """Build ``[train, valid, test]`` with ``BlendedMegatronDatasetBuilder`` (None for an empty split).

    ``num_samples`` is the number of samples wanted from each split; a split with fewer
    tokens is cycled over more epochs, as in Megatron.
    """
    for suffix in (".bin", ".idx"):
        if not Path(config.data_prefix + suffix).is_file():
            raise ValueError(
                f"{config.data_prefix}{suffix} not found: pass the prefix without .bin/.idx "
                "as written by tools/preprocess_data.py (e.g. data/demo/demo_text_document)"
            )
    if config.seq_length < 1:
        raise ValueError(f"seq_length must be 1 or more, got {config.seq_length}")
    ensure_dataset_helpers()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    dataset_config = GPTDatasetConfig(
        random_seed=config.seed,
        sequence_length=config.seq_length,
        blend=([config.data_prefix], None),
        split=config.split,
        path_to_cache=config.cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=config.create_attention_mask,
    )
    # Every caller holds data (pretrain_gpt's is_dataset_built_on_rank is true on all ranks
    # without pipeline parallelism); with torch.distributed up, rank 0 builds first.
    return BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), lambda: True, dataset_config).build()
