"""Tokenize documents into Megatron-Core indexed datasets (``.bin`` + ``.idx``).

Writes with Megatron-Core's ``IndexedDatasetBuilder``: one document per input document,
one sequence per document (no sentence splitting), token dtype chosen by Megatron's
``DType.optimal_dtype`` for the vocabulary, so ``GPTDataset`` reads the files as if
Megatron-LM's ``tools/preprocess_data.py`` had written them.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron.canzona.data.corpus import check_input_files, iter_documents
from megatron.canzona.data.tokenizer import check_tokenizer_type, load_tokenizer

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    """How to turn documents into indexed datasets."""

    json_keys: tuple[str, ...] = ("text",)
    """JSONL keys to tokenize; each key gets its own dataset ``<prefix>_<key>_document``."""
    append_eod: bool = False
    """Append the tokenizer's end-of-document id to every non-empty document."""
    workers: int = 1
    """Tokenizing processes; 1 tokenizes in this process."""
    log_interval: int = 1000
    """Log progress every this many documents."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag to fix when a field is out of range."""
        if not self.json_keys or len(set(self.json_keys)) != len(self.json_keys):
            raise ValueError(f"--json-keys needs one or more distinct keys, got {list(self.json_keys)}")
        if self.workers < 1:
            raise ValueError(f"--workers must be 1 or more, got {self.workers}")
        if self.log_interval < 1:
            raise ValueError(f"--log-interval must be 1 or more, got {self.log_interval}")


@dataclass(frozen=True)
class DatasetSummary:
    """What was written for one JSON key."""

    prefix: str
    """Path prefix of the ``.bin``/``.idx`` pair, as passed to ``--data-path``."""
    num_documents: int
    num_tokens: int
    num_empty: int
    """Documents skipped because they tokenized to nothing."""


def dataset_prefix(output_prefix: str | Path, key: str) -> str:
    """Megatron's name for the document-level dataset of ``key``: ``<prefix>_<key>_document``."""
    return f"{output_prefix}_{key}_document"


def preprocess(
    inputs: Sequence[str | Path],
    output_prefix: str | Path,
    tokenizer_model: str | Path,
    config: PreprocessConfig,
    tokenizer_type: str = "SentencePieceTokenizer",
    log: Log = _stderr,
) -> dict[str, DatasetSummary]:
    """Tokenize every document of ``inputs`` and write one indexed dataset per JSON key.

    Input problems (missing file, bad JSON, missing key, missing tokenizer) raise
    ``ValueError`` before or while reading; partial output is removed on failure.
    """
    config.validate()
    check_tokenizer_type(tokenizer_type)
    paths = check_input_files(inputs)
    out_dir = Path(output_prefix).parent
    if not out_dir.is_dir():
        raise ValueError(f"output directory does not exist: {out_dir} (create it first)")
    tokenizer = load_tokenizer(tokenizer_model, tokenizer_type)
    documents = itertools.chain.from_iterable(iter_documents(p, config.json_keys) for p in paths)
    writer = _Writer(output_prefix, config.json_keys, tokenizer.vocab_size)
    try:
        with _EncodedDocuments(documents, tokenizer_model, tokenizer_type, config) as encoded:
            _write_all(encoded, writer, config.log_interval, log)
        summaries = writer.finalize()
    except BaseException:
        writer.discard()
        raise
    for key, summary in summaries.items():
        log(f"{key}: {summary.num_documents} documents, {summary.num_tokens} tokens "
            f"({summary.num_empty} empty skipped) -> {summary.prefix}.bin/.idx")
    return summaries


def _write_all(encoded: Iterable[tuple[dict[str, np.ndarray], int]], writer: _Writer, every: int, log: Log) -> None:
    start = time.perf_counter()
    num_bytes = 0
    count = 0
    for count, (token_ids, size) in enumerate(encoded, start=1):
        writer.add(token_ids)
        num_bytes += size
        if count % every == 0:
            elapsed = max(time.perf_counter() - start, 1e-9)
            log(f"processed {count} documents ({count / elapsed:.0f} docs/s, {num_bytes / elapsed / 1e6:.2f} MB/s)")
    if count == 0:
        raise ValueError("the input files hold no documents; give files that hold text")


class _Writer:
    """One ``IndexedDatasetBuilder`` per key, written under temporary names until finalized."""

    def __init__(self, output_prefix: str | Path, keys: Sequence[str], vocab_size: int) -> None:
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        self._dtype = DType.optimal_dtype(vocab_size)
        self._final = {key: dataset_prefix(output_prefix, key) for key in keys}
        # A half-written dataset under the final name would look complete to a rerun.
        self._tmp = {key: f"{prefix}.tmp{os.getpid()}" for key, prefix in self._final.items()}
        self._builders = {key: IndexedDatasetBuilder(f"{p}.bin", dtype=self._dtype) for key, p in self._tmp.items()}
        self._counts = {key: [0, 0, 0] for key in keys}  # documents, tokens, empty

    def add(self, token_ids: dict[str, np.ndarray]) -> None:
        for key, ids in token_ids.items():
            counts = self._counts[key]
            if ids.size == 0:
                counts[2] += 1
                continue
            self._builders[key].add_document(ids, [int(ids.size)])
            counts[0] += 1
            counts[1] += int(ids.size)

    def finalize(self) -> dict[str, DatasetSummary]:
        summaries = {}
        for key, builder in self._builders.items():
            builder.finalize(f"{self._tmp[key]}.idx")
            for suffix in (".bin", ".idx"):
                os.replace(self._tmp[key] + suffix, self._final[key] + suffix)
            summaries[key] = DatasetSummary(self._final[key], *self._counts[key])
        return summaries

    def discard(self) -> None:
        for key, builder in self._builders.items():
            builder.data_file.close()
            for suffix in (".bin", ".idx"):
                Path(self._tmp[key] + suffix).unlink(missing_ok=True)


# Per-process state of the tokenizing workers (set by _init_worker).
_TOKENIZER: Any = None
_APPEND_EOD = False


def _init_worker(tokenizer_model: str, tokenizer_type: str, append_eod: bool) -> None:
    global _TOKENIZER, _APPEND_EOD
    _TOKENIZER = load_tokenizer(tokenizer_model, tokenizer_type)
    _APPEND_EOD = append_eod


def _encode(document: dict[str, str]) -> tuple[dict[str, np.ndarray], int]:
    """Token ids of each key's text (plus EOD when asked) and the document's size in bytes."""
    out = {}
    size = 0
    for key, text in document.items():
        ids = _TOKENIZER.tokenize(text)
        if ids and _APPEND_EOD:
            ids.append(_TOKENIZER.eod)
        out[key] = np.asarray(ids, dtype=np.int64)
        size += len(text.encode("utf-8"))
    return out, size


class _EncodedDocuments:
    """Context manager yielding encoded documents, from a worker pool when ``workers > 1``."""

    def __init__(
        self, documents: Iterator[dict[str, str]], model: str | Path, kind: str, config: PreprocessConfig
    ) -> None:
        self._documents = documents
        self._init_args = (str(model), kind, config.append_eod)
        self._workers = config.workers
        self._pool: Any = None

    def __enter__(self) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        if self._workers == 1:
            _init_worker(*self._init_args)
            return map(_encode, self._documents)
        # fork: workers inherit the already imported megatron.core instead of importing it
        # again (seconds each); they only run SentencePiece, which is fork-safe.
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        self._pool = context.Pool(self._workers, initializer=_init_worker, initargs=self._init_args)
        return self._pool.imap(_encode, self._documents, chunksize=32)

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
