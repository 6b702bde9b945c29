"""Data pipeline: corpus reading, SentencePiece tokenizers, Megatron indexed datasets, GPT splits and blends."""

from megatron.canzona.data.corpus import (
    book_paragraphs,
    books_to_documents,
    check_input_files,
    group_paragraphs,
    is_jsonl,
    iter_documents,
    iter_texts,
    write_jsonl,
)
from megatron.canzona.data.gpt import (
    Blend, GPTDataConfig, build_gpt_datasets, check_blend_words, check_gpt_data, describe_datasets,
)
from megatron.canzona.data.helpers import build_dataset_helpers, dataset_helpers_available, ensure_dataset_helpers
from megatron.canzona.data.indexed import DatasetSummary, PreprocessConfig, dataset_prefix, preprocess
from megatron.canzona.data.tokenizer import (
    SENTENCEPIECE_TOKENIZER_TYPES,
    TokenizerTrainConfig,
    check_tokenizer_model,
    check_tokenizer_type,
    load_tokenizer,
    train_sentencepiece,
)

__all__ = [
    "SENTENCEPIECE_TOKENIZER_TYPES",
    "Blend",
    "DatasetSummary",
    "GPTDataConfig",
    "PreprocessConfig",
    "TokenizerTrainConfig",
    "book_paragraphs",
    "books_to_documents",
    "build_dataset_helpers",
    "build_gpt_datasets",
    "check_blend_words",
    "check_gpt_data",
    "check_input_files",
    "check_tokenizer_model",
    "check_tokenizer_type",
    "dataset_helpers_available",
    "dataset_prefix",
    "describe_datasets",
    "ensure_dataset_helpers",
    "group_paragraphs",
    "is_jsonl",
    "iter_documents",
    "iter_texts",
    "load_tokenizer",
    "preprocess",
    "train_sentencepiece",
    "write_jsonl",
]
