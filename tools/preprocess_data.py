#!/usr/bin/env python
"""Tokenize text or JSONL into Megatron indexed datasets (``.bin`` + ``.idx``).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/demo/demo \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/demo/tokenizer.model \\
        --json-keys text --append-eod --workers 2

Flags follow Megatron-LM's ``tools/preprocess_data.py``; output goes to
``<output-prefix>_<key>_document.bin/.idx`` for each JSON key, the prefix to pass to
``--data-path``. JSONL files (``.jsonl``/``.json``) give one document per line; other files
give one document per blank-line-separated block (under the first JSON key). Not
supported: sentence splitting (``--split-sentences``), ``--partitions``, and tokenizers other
than SentencePiece (no tokenizer hub is reachable offline).
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron.canzona.cli import ArgumentParser, at_least
from megatron.canzona.data.indexed import PreprocessConfig, preprocess
from megatron.canzona.data.tokenizer import SENTENCEPIECE_TOKENIZER_TYPES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Megatron-LM's preprocess_data flags that apply to SentencePiece document datasets."""
    defaults = PreprocessConfig()
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True, help="text or JSONL file(s)")
    group.add_argument("--json-keys", nargs="+", default=list(defaults.json_keys),
                       help="JSONL keys to extract (default: text)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True,
                       help=f"one of {', '.join(SENTENCEPIECE_TOKENIZER_TYPES)}")
    group.add_argument("--tokenizer-model", required=True, help="SentencePiece .model file")
    group.add_argument("--append-eod", action="store_true", help="append an end-of-document token to each document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=at_least(1), default=defaults.workers, help="tokenizing processes (default: 1)")
    group.add_argument("--log-interval", type=at_least(1), default=defaults.log_interval,
                       help="log progress every N documents (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the tool; return the exit status (2 with a one-line error for bad input)."""
    args = parse_args(argv)
    config = PreprocessConfig(
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        workers=args.workers,
        log_interval=args.log_interval,
    )
    start = time.perf_counter()
    try:
        summaries = preprocess(args.input, args.output_prefix, args.tokenizer_model, config, args.tokenizer_type)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"done in {time.perf_counter() - start:.1f} s; --data-path "
          + " ".join(summary.prefix for summary in summaries.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
