#!/usr/bin/env python
"""Train a SentencePiece tokenizer (BPE or unigram) on text or JSONL files.

    python tools/train_tokenizer.py --input data/gutenberg/*.txt --output-prefix data/demo/tokenizer
    python tools/train_tokenizer.py --input corpus.jsonl --json-key text --vocab-size 4096 --model-type unigram

Writes ``<prefix>.model`` (pass it to ``--tokenizer-model`` with
``--tokenizer-type SentencePieceTokenizer``) and ``<prefix>.vocab``. JSONL files
(``.jsonl``/``.json``) give one document per line under ``--json-key``; other files give
one document per blank-line-separated block. Special ids: unk 0, bos 1, eos/eod 2, pad 3.
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron.canzona.cli import ArgumentParser, at_least, fraction
from megatron.canzona.data.corpus import check_input_files, iter_texts
from megatron.canzona.data.tokenizer import MODEL_TYPES, TokenizerTrainConfig, train_sentencepiece


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with defaults from ``TokenizerTrainConfig``."""
    defaults = TokenizerTrainConfig()
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--json-key", default="text", help="JSONL key holding the text (default: text)")
    parser.add_argument("--vocab-size", type=at_least(1), default=defaults.vocab_size, help="default: %(default)s")
    parser.add_argument("--model-type", choices=MODEL_TYPES, default=defaults.model_type, help="default: %(default)s")
    parser.add_argument("--character-coverage", type=fraction, default=defaults.character_coverage)
    parser.add_argument("--no-byte-fallback", action="store_true",
                        help="map unseen characters to <unk> instead of UTF-8 byte pieces")
    parser.add_argument("--max-sentences", type=at_least(1), default=defaults.max_sentences,
                        help="sample at most this many documents for training (default: %(default)s)")
    parser.add_argument("--threads", type=at_least(1), default=defaults.num_threads, help="default: %(default)s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the tool; return the exit status (2 with a one-line error for bad input)."""
    args = parse_args(argv)
    config = TokenizerTrainConfig(
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        byte_fallback=not args.no_byte_fallback,
        character_coverage=args.character_coverage,
        max_sentences=args.max_sentences,
        num_threads=max(1, args.threads),
    )
    start = time.perf_counter()
    try:
        paths = check_input_files(args.input)
        print(f"training a {config.model_type} tokenizer, vocab {config.vocab_size}, on {len(paths)} file(s)",
              file=sys.stderr, flush=True)
        model = train_sentencepiece(iter_texts(paths, (args.json_key,)), args.output_prefix, config)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {model} and {model.with_suffix('.vocab')} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
