"""pretrain_gpt.py takes its data and tokenizer flags as Megatron's pretrain_gpt.py does: real runs.

Tiny one-rank runs, forked from one process after one import
(``support.run_cases``), each a data form with a tokenizer type:

* ``--data-path 0.3 A 0.7 B`` with ``--tokenizer-type HuggingFaceTokenizer`` (a local directory);
* ``--train-data-path A --valid-data-path B`` with ``GPT2BPETokenizer`` (``--vocab-file``,
  ``--merge-file``);
* ``--mock-data`` with ``NullTokenizer`` (``--vocab-size``);
* ``--data-args-path FILE`` with ``SentencePieceTokenizer``;

and a blend naming a missing dataset, which stops with one line.

The byte-level BPE tokenizer and its datasets are made here from two shipped books. The
in-process tests of every data form are in ``tests/integration/test_data_blends.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from megatron.canzona.data import book_paragraphs, group_paragraphs

from .support import ROOT, DemoData, run_cases
from .test_pretrain_gpt import QWEN3_TINY

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 300
BPE_VOCAB_SIZE = 400
EOD_TOKEN = "<|endoftext|>"
ITERS, GLOBAL_BATCH = 4, 4
# Megatron's GPT2BPETokenizer asks the Hugging Face hub's "gpt2" for its tokenizer class (the
# vocabulary comes from --vocab-file/--merge-file). Offline, the hub cache must answer; this
# one holds just that answer.
GPT2_CACHE_FILES = {"config.json": {"model_type": "gpt2"},
                    "tokenizer_config.json": {"tokenizer_class": "GPT2Tokenizer"}}


@dataclass(frozen=True)
class BpeData:
    """A byte-level BPE tokenizer in both formats, its offline hub cache, and two datasets."""

    hf_dir: Path
    vocab_file: Path
    merge_file: Path
    hf_home: Path
    alice: str
    emma: str


def book_documents(name: str, num_chars: int) -> list[str]:
    paragraphs, size = [], 0
    for paragraph in book_paragraphs((ROOT / "data" / "books" / name).read_text()):
        if size > num_chars:
            break
        paragraphs.append(paragraph)
        size += len(paragraph)
    return group_paragraphs(paragraphs, 1000)


def write_dataset(prefix: Path, documents: list[list[int]]) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for ids in documents:
        builder.add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> BpeData:
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("bpe")
    books = {"alice": book_documents("carroll-alice.txt", 25_000), "emma": book_documents("austen-emma.txt", 25_000)}
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator([text for texts in books.values() for text in texts], vocab_size=BPE_VOCAB_SIZE,
                                  min_frequency=2, special_tokens=[EOD_TOKEN], show_progress=False)
    assert tokenizer.get_vocab_size() == BPE_VOCAB_SIZE
    hf_dir = out / "hf"
    hf_dir.mkdir()
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN}))
    vocab_file, merge_file = map(Path, tokenizer.save_model(str(out)))
    snapshot = out / "hf_home" / "hub" / "models--gpt2" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    for name, content in GPT2_CACHE_FILES.items():
        (snapshot / name).write_text(json.dumps(content))
    eod = tokenizer.token_to_id(EOD_TOKEN)
    prefixes = {name: write_dataset(out / name, [tokenizer.encode(text).ids + [eod] for text in texts])
                for name, texts in books.items()}
    return BpeData(hf_dir, vocab_file, merge_file, out / "hf_home", prefixes["alice"], prefixes["emma"])


def run_flags(out: Path, *extra: str) -> list[str]:
    """Four iterations of qwen3-tiny with AdamW, evaluated once at the end, metrics into ``out``."""
    return [
        *QWEN3_TINY, "--micro-batch-size", "2", "--global-batch-size", str(GLOBAL_BATCH),
        "--train-iters", str(ITERS), "--lr", "3e-3", "--log-interval", "2", "--eval-interval", str(ITERS),
        "--eval-iters", "1", "--optimizer", "adam", "--num-workers", "0",
        "--data-cache-path", str(out / "cache"), "--canzona-metrics-file", str(out / "metrics.jsonl"), *extra,
    ]


def test_each_data_form_and_tokenizer_type_trains(bpe: BpeData, demo_data: DemoData, tmp_path: Path) -> None:
    data_args = tmp_path / "data_args.txt"
    data_args.write_text(f"{demo_data.data_prefix}\n")
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(bpe.hf_dir)]
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(bpe.vocab_file),
            "--merge-file", str(bpe.merge_file)]
    cases = {
        "hf_blend": [*hf, "--data-path", "0.3", bpe.alice, "0.7", bpe.emma, "--split", "90,5,5"],
        "gpt2_per_split": [*gpt2, "--train-data-path", bpe.alice, "--valid-data-path", bpe.emma],
        "null_mock": ["--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--mock-data"],
        "sentencepiece_data_args": ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                    str(demo_data.tokenizer_model), "--data-args-path", str(data_args),
                                    "--split", "80,10,10"],
        # A blend naming a missing dataset stops with one line, not a traceback.
        "missing_prefix": ["--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
                           "--data-path", "0.5", bpe.alice, "0.5", f"{bpe.alice}_missing", "--split", "90,5,5"],
    }
    flags = {name: run_flags(tmp_path / name, *case) for name, case in cases.items()}
    env = {"HF_HOME": str(bpe.hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    runs = run_cases(flags, timeout_s=RUN_TIMEOUT_S, env=env)
    missing = runs.pop("missing_prefix")
    assert missing["returncode"] == 2, missing["output"][-4000:]
    assert missing["output"].rstrip().splitlines()[-1] == (
        f"pretrain_gpt.py: error: {bpe.alice}_missing.bin not found: pass the prefix without .bin/.idx "
        "as written by tools/preprocess_data.py (e.g. data/demo/demo_text_document)")
    for name, run in runs.items():
        assert run["returncode"] == 0, f"{name}:\n{run['output'][-4000:]}"
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [m["iteration"] for m in metrics] == [1, 2, 4], name
        assert all(np.isfinite(m["lm_loss"]) and m["lm_loss"] > 0 for m in metrics), name

    # The blend is used: 16 training samples drawn 0.3 : 0.7 (rounded up per dataset).
    assert (f"train: 17 samples, blend of 2: 5 from {bpe.alice} (weight 0.300), "
            f"12 from {bpe.emma} (weight 0.700)") in runs["hf_blend"]["output"]
    per_split = runs["gpt2_per_split"]["output"]
    assert re.search(rf"train: \d+ samples from {re.escape(bpe.alice)}\n", per_split)
    assert re.search(rf"validation: \d+ samples from {re.escape(bpe.emma)}\n", per_split) and "test: none" in per_split
    assert re.search(r"train: \d+ mock samples\n", runs["null_mock"]["output"])
    assert f"samples from {demo_data.data_prefix}\n" in runs["sentencepiece_data_args"]["output"]
    # Each model was built for its tokenizer's vocabulary: 400 (both BPE formats) and 512 pad to
    # the same 512 rows, so every run has the same parameter count (GPT-2's 50257 would not).
    counts = {name: re.findall(r"number of parameters on \([^)]*\) model parallel rank \([^)]*\): (\d+)",
                               run["output"]) for name, run in runs.items()}
    assert all(len(found) == 1 for found in counts.values()), counts
    assert len({found[0] for found in counts.values()}) == 1, counts
