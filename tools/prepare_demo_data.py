#!/usr/bin/env python
"""Prepare the CPU demo's data: books -> corpus.jsonl -> tokenizer -> Megatron indexed dataset.

    python tools/prepare_demo_data.py                         # shipped books -> data/demo/
    python tools/prepare_demo_data.py --output-dir /tmp/demo --vocab-size 2048
    python tools/prepare_demo_data.py --books more/*.txt data/books/*.txt --output-dir data/demo-large

Each step is skipped when its outputs exist and were made from the same inputs and
settings (a fingerprint in ``<output-dir>/prepare_state.json``); ``--force`` redoes all.
The last lines printed are the flags that point pretrain_gpt.py at the result.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from megatron.canzona.cli import ArgumentParser, at_least  # noqa: E402
from megatron.canzona.data.corpus import books_to_documents, check_input_files, iter_texts, write_jsonl  # noqa: E402
from megatron.canzona.data.indexed import PreprocessConfig, dataset_prefix, preprocess  # noqa: E402
from megatron.canzona.data.tokenizer import MODEL_TYPES, TokenizerTrainConfig, train_sentencepiece  # noqa: E402

DEFAULT_BOOKS = sorted(glob.glob(str(ROOT / "data" / "books" / "*.txt")))
STATE_FILE = "prepare_state.json"


def log(message: str) -> None:
    """Progress goes to stderr so stdout carries only the final flags."""
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--books", nargs="+", default=DEFAULT_BOOKS,
                        help="plain-text books (default: the shipped data/books/*.txt)")
    parser.add_argument("--output-dir", default=str(ROOT / "data" / "demo"), help="default: data/demo")
    parser.add_argument("--vocab-size", type=at_least(1), default=1024, help="default: %(default)s")
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="bpe", help="default: %(default)s")
    parser.add_argument("--max-doc-chars", type=at_least(1), default=4000,
                        help="paragraphs are grouped into documents of at most this many characters")
    parser.add_argument("--workers", type=at_least(1), default=1, help="tokenizing processes (default: 1)")
    parser.add_argument("--force", action="store_true", help="redo every step")
    return parser.parse_args(argv)


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(settings: dict, inputs: Sequence[Path]) -> str:
    """What a step's outputs depend on: its settings and the bytes of its input files."""
    described = {"settings": settings, "inputs": [[p.name, file_digest(p)] for p in inputs]}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


class Steps:
    """Runs named steps, skipping those whose outputs match the recorded fingerprint."""

    def __init__(self, output_dir: Path, force: bool) -> None:
        self._path = output_dir / STATE_FILE
        self._force = force
        self._state = {} if force or not self._path.is_file() else json.loads(self._path.read_text())

    def run(self, name: str, outputs: Sequence[Path], stamp: str, work: Callable[[], str]) -> None:
        """Do ``work`` (which returns a one-line summary) unless step ``name`` is up to date."""
        if not self._force and self._state.get(name) == stamp and all(p.is_file() for p in outputs):
            log(f"[{name}] up to date, skipped ({', '.join(p.name for p in outputs)})")
            return
        start = time.perf_counter()
        log(f"[{name}] running ...")
        summary = work()
        self._state[name] = stamp
        self._path.write_text(json.dumps(self._state, indent=1, sort_keys=True) + "\n")
        log(f"[{name}] {summary} ({time.perf_counter() - start:.1f} s)")


def prepare(args: argparse.Namespace) -> str:
    """Run the three steps and return the data prefix for ``--data-path``."""
    books = check_input_files(args.books)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = Steps(out, args.force)
    corpus, model = out / "corpus.jsonl", out / "tokenizer.model"
    prefix = dataset_prefix(out / "demo", "text")
    train_config = TokenizerTrainConfig(vocab_size=args.vocab_size, model_type=args.model_type)
    train_config.validate()

    def make_corpus() -> str:
        count = write_jsonl(books_to_documents(books, args.max_doc_chars), corpus)
        return f"{len(books)} books -> {count} documents in {corpus}"

    def make_tokenizer() -> str:
        train_sentencepiece(iter_texts([corpus]), out / "tokenizer", train_config, log=log)
        return f"wrote {model}"

    def make_dataset() -> str:
        config = PreprocessConfig(append_eod=True, workers=args.workers, log_interval=1000)
        summary = preprocess([corpus], out / "demo", model, config, log=log)["text"]
        return f"{summary.num_documents} documents, {summary.num_tokens} tokens -> {prefix}.bin/.idx"

    steps.run("corpus", [corpus], fingerprint({"max_doc_chars": args.max_doc_chars}, books), make_corpus)
    tokenizer_settings = {"vocab_size": args.vocab_size, "model_type": args.model_type}
    steps.run("tokenizer", [model], fingerprint(tokenizer_settings, [corpus]), make_tokenizer)
    dataset_outputs = [Path(prefix + ".bin"), Path(prefix + ".idx")]
    steps.run("dataset", dataset_outputs, fingerprint({"append_eod": True}, [corpus, model]), make_dataset)
    return prefix


def main(argv: list[str] | None = None) -> int:
    """Run the tool; return the exit status (2 with a one-line error for bad input)."""
    args = parse_args(argv)
    if not args.books:
        print("error: no books found in data/books/; pass --books FILE [FILE ...]", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        prefix = prepare(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = Path(args.output_dir) / "tokenizer.model"
    log(f"demo data ready in {time.perf_counter() - start:.1f} s; pass to pretrain_gpt.py:")
    print(f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {model} --data-path {prefix} --split 949,50,1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
