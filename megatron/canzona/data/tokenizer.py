"""Train a SentencePiece tokenizer and load it as Megatron-Core's own tokenizer.

Training needs only ``sentencepiece``. Loading returns Megatron-Core's
``GPTTokenizer`` around its ``SentencePieceTokenizer`` library class, built with the same
arguments as ``megatron.core.tokenizers.utils.build_tokenizer`` uses for
``--tokenizer-type SentencePieceTokenizer``, so preprocessing and training tokenize alike.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Megatron's names for SentencePiece-backed tokenizers (build_tokenizer's SP_TOKENIZERS).
SENTENCEPIECE_TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
MODEL_TYPES = ("bpe", "unigram")

# Fixed ids so every model this project trains has the same special tokens:
# Megatron's tokenizer reports eos as `eod` (it has no eod of its own) and pad as `pad`.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
_NUM_SPECIAL = 4
_NUM_BYTE_PIECES = 256

# SentencePiece skips longer "sentences"; documents are cut at paragraphs below this.
_MAX_SENTENCE_BYTES = 1 << 16

_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


@dataclass(frozen=True, kw_only=True)
class TokenizerTrainConfig:
    """How to train a SentencePiece model."""

    vocab_size: int = 1024
    """Number of pieces, special tokens and (with byte fallback) the 256 byte pieces included."""
    model_type: str = "bpe"
    """SentencePiece algorithm: ``bpe`` (as Qwen3's tokenizer) or ``unigram``."""
    byte_fallback: bool = True
    """Encode characters unseen in training as UTF-8 bytes instead of ``<unk>`` (exact round trip)."""
    character_coverage: float = 1.0
    """Fraction of characters kept as pieces; 1.0 suits English text."""
    max_sentences: int = 2_000_000
    """Train on at most this many sentences, sampled at random, to bound memory and time."""
    num_threads: int = max(1, os.cpu_count() or 1)
    """Trainer threads."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag to fix when a field is out of range."""
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"--model-type must be one of {', '.join(MODEL_TYPES)}, got {self.model_type!r}")
        floor = _NUM_SPECIAL + 1 + (_NUM_BYTE_PIECES if self.byte_fallback else 0)
        if self.vocab_size < floor:
            hint = " (byte fallback needs 256 byte pieces; or pass --no-byte-fallback)" if self.byte_fallback else ""
            raise ValueError(f"--vocab-size {self.vocab_size} is too small: use at least {floor}{hint}")
        if not 0.0 < self.character_coverage <= 1.0:
            raise ValueError(f"--character-coverage must be in (0, 1], got {self.character_coverage}")
        if self.max_sentences < 1:
            raise ValueError(f"--max-sentences must be 1 or more, got {self.max_sentences}")


def trainer_sentences(texts: Iterable[str], max_bytes: int = _MAX_SENTENCE_BYTES) -> Iterator[str]:
    """Yield training sentences: whole documents, cut at blank lines only when too long.

    Whole documents keep the newlines between paragraphs, so the model learns pieces
    for them instead of spelling them as bytes.
    """
    for text in texts:
        if not text.strip():
            continue
        if len(text.encode("utf-8")) <= max_bytes:
            yield text
            continue
        for paragraph in text.split("\n\n"):
            data = paragraph.encode("utf-8")
            for start in range(0, len(data), max_bytes):
                piece = data[start : start + max_bytes].decode("utf-8", errors="ignore")
                if piece.strip():
                    yield piece


def train_sentencepiece(
    texts: Iterable[str],
    output_prefix: str | Path,
    config: TokenizerTrainConfig,
    log: Callable[[str], None] = lambda message: print(message, file=sys.stderr, flush=True),
) -> Path:
    """Train on ``texts``; write ``<output_prefix>.model`` and ``.vocab``; return the model path.

    Raises ``ValueError`` with the fix when the input holds no text or the vocabulary does
    not fit the data.
    """
    import sentencepiece as spm

    config.validate()
    prefix = Path(output_prefix)
    if not prefix.parent.is_dir():
        raise ValueError(f"output directory does not exist: {prefix.parent} (create it first)")
    counted = _Counted(trainer_sentences(texts), log)
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=counted, model_prefix=str(prefix), **_trainer_options(config))
    except RuntimeError as error:
        raise _explain_trainer_error(error, config, counted.count) from None
    if counted.count == 0:
        raise ValueError("no text found in the input files; give files that hold text")
    log(f"trained {config.model_type} vocab {config.vocab_size} on {counted.count} documents "
        f"({counted.num_bytes / 1e6:.2f} MB) -> {prefix}.model")
    return prefix.with_name(prefix.name + ".model")


def _trainer_options(config: TokenizerTrainConfig) -> dict[str, Any]:
    return {
        "vocab_size": config.vocab_size,
        "model_type": config.model_type,
        "byte_fallback": config.byte_fallback,
        "character_coverage": config.character_coverage,
        "input_sentence_size": config.max_sentences,
        "shuffle_input_sentence": True,
        "num_threads": config.num_threads,
        "max_sentence_length": _MAX_SENTENCE_BYTES,
        # Identity normalization and kept whitespace make decode(encode(text)) == text,
        # which pretraining text (indentation, blank lines) needs.
        "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False,
        "split_digits": True,
        "unk_id": UNK_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "pad_id": PAD_ID,
        "minloglevel": 2,  # the trainer's own log is thousands of lines; we log progress
    }


class _Counted:
    """Iterator over sentences that counts them and logs progress while the trainer reads."""

    def __init__(self, sentences: Iterator[str], log: Callable[[str], None], every: int = 10_000) -> None:
        self._sentences = sentences
        self._log = log
        self._every = every
        self.count = 0
        self.num_bytes = 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> str:
        sentence = next(self._sentences)
        self.count += 1
        self.num_bytes += len(sentence.encode("utf-8"))
        if self.count % self._every == 0:
            self._log(f"read {self.count} documents ({self.num_bytes / 1e6:.1f} MB)")
        return sentence


def _explain_trainer_error(error: RuntimeError, config: TokenizerTrainConfig, count: int) -> ValueError:
    message = str(error)
    if count == 0:
        return ValueError("no text found in the input files; give files that hold text")
    if match := _TOO_HIGH.search(message):
        return ValueError(
            f"--vocab-size {config.vocab_size} is too large for this data (at most {match.group(2)} pieces "
            f"can be learned from it): pass --vocab-size {match.group(2)} or less, or give more text"
        )
    if match := _TOO_SMALL.search(message):
        return ValueError(
            f"--vocab-size {config.vocab_size} is too small: the data has {match.group(2)} required "
            f"characters and special pieces; raise --vocab-size or lower --character-coverage"
        )
    return ValueError(f"SentencePiece training failed: {message.splitlines()[-1] if message else error!r}")


def check_tokenizer_type(tokenizer_type: str) -> None:
    """Raise ``ValueError`` unless ``tokenizer_type`` is a SentencePiece type this project can load."""
    if tokenizer_type not in SENTENCEPIECE_TOKENIZER_TYPES:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type} is not supported here: use SentencePieceTokenizer with a "
            "model from tools/train_tokenizer.py (HuggingFace hub tokenizers cannot be downloaded offline)"
        )


def load_tokenizer(model_path: str | Path, tokenizer_type: str = "SentencePieceTokenizer") -> Any:
    """Load ``model_path`` as Megatron-Core's GPT tokenizer.

    It has what ``GPTDataset`` and training use: ``tokenize``, ``detokenize``, ``eod``,
    ``pad``, ``vocab_size``.
    """
    check_tokenizer_type(tokenizer_type)
    path = Path(model_path)
    if not path.is_file():
        raise ValueError(f"tokenizer model not found: {path} (train one with tools/train_tokenizer.py)")
    # Imported here: megatron.core takes seconds to import and training a tokenizer needs none of it.
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=str(path),
        metadata_path={"library": "sentencepiece", "model_type": "gpt"},
        # The keyword arguments build_tokenizer passes for SentencePiece with Megatron's defaults.
        chat_template=None,
        ignore_extra_whitespaces=True,
        legacy=False,
        special_tokens=None,
    )


HUGGING_FACE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What marks a Hugging Face tokenizer directory (``--tokenizer-type HuggingFaceTokenizer`` loads the directory)."""


def check_tokenizer_model(path: str, tokenizer_type: str) -> None:
    """``ValueError`` unless ``path`` loads as ``tokenizer_type`` would load it (SentencePiece
    models are loaded; a Hugging Face tokenizer is a directory or a hub name), saying which file
    to pass where the user named a sibling of the right one (the ``.vocab`` beside a ``.model``,
    the ``tokenizer.json`` inside a directory)."""
    named = Path(path)
    if tokenizer_type in SENTENCEPIECE_TOKENIZER_TYPES:
        import sentencepiece as spm

        try:
            spm.SentencePieceProcessor(model_file=str(named))
            return
        except (RuntimeError, OSError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        folder = named if named.is_dir() else named.parent
        stem = None if named.is_dir() else named.stem
        models = sorted(p for p in folder.glob("*.model") if p != named and (stem is None or p.stem == stem)) \
            or sorted(p for p in folder.glob("*.model") if p != named)
        hint = f"pass {models[0]}" if models else "pass the .model file tools/train_tokenizer.py wrote"
        what = "a directory" if named.is_dir() else f"not a SentencePiece model ({reason})"
        raise ValueError(f"--tokenizer-model {path} is {what}; --tokenizer-type {tokenizer_type} loads a "
                         f"SentencePiece .model file: {hint}")
    if tokenizer_type == "HuggingFaceTokenizer" and named.is_file() and any(
            (named.parent / marker).is_file() for marker in HUGGING_FACE_TOKENIZER_FILES):
        raise ValueError(f"--tokenizer-model {path} is a file of a Hugging Face tokenizer; --tokenizer-type "
                         f"HuggingFaceTokenizer loads its directory: pass {named.parent}")
