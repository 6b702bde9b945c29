"""The demo data pipeline: tokenizer training, Megatron indexed datasets, GPTDataset splits.

Runs the tools as a user does (subprocesses) on a small slice of the shipped corpus, then
reads the results with Megatron-Core's own IndexedDataset and GPTDataset.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.canzona.data import (
    GPTDataConfig,
    PreprocessConfig,
    book_paragraphs,
    build_dataset_helpers,
    build_gpt_datasets,
    check_gpt_data,
    dataset_helpers_available,
    ensure_dataset_helpers,
    group_paragraphs,
    load_tokenizer,
    preprocess,
    write_jsonl,
)

ROOT = Path(__file__).resolve().parents[2]
BOOKS = ROOT / "data" / "books"
# Characters outside the training text, and whitespace a lossy tokenizer would collapse.
UNUSUAL = "Naïve café — 東京 ✓\n\n    indented  twice\tand tabbed\n"


def run_tool(tool: str, *args: str | Path) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "tools" / tool), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)


def alice_documents(num_chars: int, max_doc_chars: int) -> list[str]:
    """The first ``num_chars`` characters of the shipped Alice, as documents."""
    paragraphs, size = [], 0
    for paragraph in book_paragraphs((BOOKS / "carroll-alice.txt").read_text()):
        if size > num_chars:
            break
        paragraphs.append(paragraph)
        size += len(paragraph)
    return group_paragraphs(paragraphs, max_doc_chars)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_pipeline")


@pytest.fixture(scope="module")
def corpus(work) -> tuple[Path, list[str]]:
    texts = alice_documents(60_000, 1500) + [UNUSUAL]
    path = work / "corpus.jsonl"
    write_jsonl(({"text": text, "id": str(i)} for i, text in enumerate(texts)), path)
    return path, texts


@pytest.fixture(scope="module")
def tokenizer_model(work, corpus) -> Path:
    out = run_tool("train_tokenizer.py", "--input", corpus[0], "--output-prefix", work / "tok", "--vocab-size", "512")
    assert out.returncode == 0, out.stderr
    assert "trained bpe vocab 512" in out.stderr
    return work / "tok.model"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_model):
    return load_tokenizer(tokenizer_model)


@pytest.fixture(scope="module")
def eod_dataset(work, corpus, tokenizer_model) -> str:
    out = run_tool("preprocess_data.py", "--input", corpus[0], "--output-prefix", work / "alice",
                   "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer_model,
                   "--json-keys", "text", "--append-eod", "--workers", "2", "--log-interval", "10")
    assert out.returncode == 0, out.stderr
    assert "processed 10 documents" in out.stderr
    return str(work / "alice_text_document")


def indexed(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix)


@pytest.mark.quick
def test_tokenizer_round_trips_text(tokenizer, corpus):
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad, tokenizer.unk) == (512, 2, 3, 0)
    for text in corpus[1][:5] + [UNUSUAL]:
        ids = tokenizer.tokenize(text)
        assert tokenizer.detokenize(ids) == text
        assert tokenizer.eod not in ids and tokenizer.unk not in ids
    # Pieces are learned, not spelled out: English compresses well below one id per byte.
    text = corpus[1][0]
    assert len(tokenizer.tokenize(text)) < len(text.encode()) / 2


def test_tokenizer_is_what_megatron_build_tokenizer_gives(tokenizer_model, tokenizer, corpus):
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    args = argparse.Namespace(
        tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(tokenizer_model), metadata_path=None,
        chat_template=None, tokenizer_sentencepiece_ignore_extra_whitespaces=True,
        tokenizer_sentencepiece_legacy=False, special_tokens=None, pad_vocab_size=False,
    )
    megatrons = build_tokenizer(args)
    for text in corpus[1][:3] + [UNUSUAL]:
        assert megatrons.tokenize(text) == tokenizer.tokenize(text)
    assert megatrons.eod == tokenizer.eod and megatrons.vocab_size == tokenizer.vocab_size


def test_preprocess_writes_the_tokenizer_ids_and_eod(eod_dataset, corpus, tokenizer):
    data = indexed(eod_dataset)
    texts = corpus[1]
    assert len(data) == len(texts) and data.index.dtype == np.uint16
    assert list(data.document_indices) == list(range(len(texts) + 1))
    for i in (0, 1, len(texts) // 2, len(texts) - 1):
        assert data[i].tolist() == tokenizer.tokenize(texts[i]) + [tokenizer.eod]


def test_preprocess_without_eod_and_from_plain_text(work, tokenizer_model, tokenizer):
    text_file = work / "plain.txt"
    blocks = ["First block,\nwrapped over two lines.", "Second block.", UNUSUAL.strip("\n").split("\n\n")[1]]
    text_file.write_text("\n\n\n".join(blocks) + "\n")
    summary = preprocess([text_file], work / "plain", tokenizer_model, PreprocessConfig(), log=lambda _: None)
    data = indexed(summary["text"].prefix)
    assert [data[i].tolist() for i in range(len(data))] == [tokenizer.tokenize(b) for b in blocks]
    assert summary["text"].num_documents == 3 and summary["text"].prefix.endswith("plain_text_document")


def test_gpt_dataset_splits_yield_seq_length_samples(eod_dataset, tokenizer, work):
    config = GPTDataConfig(data_prefix=eod_dataset, seq_length=64, split="80,10,10", cache_dir=str(work / "cache"))
    train, valid, test = build_gpt_datasets(config, tokenizer, (16, 4, 4))
    assert len(train) >= 16 and len(valid) >= 4 and len(test) >= 4
    data = indexed(eod_dataset)
    stream = np.concatenate([data[int(d)] for d in train.document_index]).astype(np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(stream, 65)
    num_eod = 0
    for i in range(len(train)):
        sample = train[i]
        tokens, labels = sample["tokens"].numpy(), sample["labels"].numpy()
        assert tokens.shape == labels.shape == (64,)
        assert (tokens[1:] == labels[:-1]).all() and int(tokens.max()) < tokenizer.vocab_size
        if i < 8:  # each sample is 65 consecutive tokens of the train documents in the dataset's order
            assert (windows == np.append(tokens, labels[-1])).all(axis=1).any()
        num_eod += int((tokens == tokenizer.eod).sum())
    assert num_eod > 0, "the documents end in EOD, so some samples must hold one"


def test_dataset_helpers_ship_with_megatron_core():
    assert dataset_helpers_available()
    ensure_dataset_helpers()  # a no-op when the wheel's prebuilt module imports


@pytest.mark.slow
def test_dataset_helpers_build_from_source(tmp_path):
    pytest.importorskip("pybind11")
    import importlib.util

    built = build_dataset_helpers(tmp_path)
    spec = importlib.util.spec_from_file_location("helpers_cpp", built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert hasattr(module, "build_sample_idx_int32") and hasattr(module, "build_blending_indices")


def test_prepare_demo_data_runs_once_then_skips(tmp_path):
    books = []
    for i, chunk in enumerate((alice_documents(20_000, 3000), alice_documents(40_000, 3000)[-3:])):
        books.append(tmp_path / f"book{i}.txt")
        books[-1].write_text("\n\n".join(chunk))
    out_dir = tmp_path / "demo"
    args = ["--books", *books, "--output-dir", out_dir, "--vocab-size", "400"]
    first = run_tool("prepare_demo_data.py", *args)
    assert first.returncode == 0, first.stderr
    prefix = str(out_dir / "demo_text_document")
    assert first.stdout.split() == ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                    str(out_dir / "tokenizer.model"), "--data-path", prefix, "--split", "949,50,1"]
    stamps = {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()}
    second = run_tool("prepare_demo_data.py", *args)
    assert second.returncode == 0, second.stderr
    assert second.stderr.count("up to date, skipped") == 3
    assert {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()} == stamps
    records = [json.loads(line) for line in (out_dir / "corpus.jsonl").read_text().splitlines()]
    assert len(indexed(prefix)) == len(records) and {r["source"] for r in records} == {"book0.txt", "book1.txt"}


def test_shipped_books_match_their_checksums():
    sums = dict(reversed(line.split()) for line in (BOOKS / "SHA256SUMS").read_text().splitlines())
    assert sorted(sums) == sorted(p.name for p in BOOKS.glob("*.txt")) and len(sums) == 5
    for name, digest in sums.items():
        assert hashlib.sha256((BOOKS / name).read_bytes()).hexdigest() == digest, name
    assert (ROOT / "data" / "LICENSE").is_file()


@pytest.mark.parametrize("tool,args,hint", [
    ("train_tokenizer.py", ["--input", "nope.txt", "--output-prefix", "{tmp}/t"], "input file not found: nope.txt"),
    ("train_tokenizer.py", ["--input", "{small}", "--output-prefix", "{tmp}/t"], "pass --vocab-size"),
    ("train_tokenizer.py", ["--input", "{blank}", "--output-prefix", "{tmp}/t"], "no text found"),
    ("train_tokenizer.py", ["--input", "{small}", "--output-prefix", "{tmp}/t", "--vocab-size", "100"],
     "use at least 261"),
    ("train_tokenizer.py", ["--input", "{small}", "--output-prefix", "{tmp}/no/such/dir/t"],
     "output directory does not exist"),
    ("preprocess_data.py", ["--input", "{small}", "--output-prefix", "{tmp}/p", "--tokenizer-type",
                            "SentencePieceTokenizer", "--tokenizer-model", "{tmp}/missing.model"],
     "train one with tools/train_tokenizer.py"),
    ("preprocess_data.py", ["--input", "{small}", "--output-prefix", "{tmp}/p", "--tokenizer-type",
                            "HuggingFaceTokenizer", "--tokenizer-model", "Qwen/Qwen3-0.6B"],
     "use SentencePieceTokenizer"),
    ("preprocess_data.py", ["--input", "nope.jsonl", "--output-prefix", "{tmp}/p", "--tokenizer-type",
                            "SentencePieceTokenizer", "--tokenizer-model", "{tmp}/missing.model"],
     "input file not found"),
    ("prepare_demo_data.py", ["--books", "nope.txt", "--output-dir", "{tmp}/d"], "input file not found"),
])
def test_bad_input_gives_one_line_error(tmp_path, tool, args, hint):
    (tmp_path / "small.txt").write_text("A tiny text.\n\nToo small for a big vocabulary.\n")
    (tmp_path / "blank.txt").write_text("\n   \n\n")
    paths = {"tmp": tmp_path, "small": tmp_path / "small.txt", "blank": tmp_path / "blank.txt"}
    out = run_tool(tool, *(arg.format(**paths) for arg in args))
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert hint in errors[0], errors[0]


# Forking after torch started its thread is what Megatron-LM's preprocess_data does too;
# the workers run only SentencePiece.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("line,hint", [
    ("not json at all", "not valid JSON"),
    ('{"body": "text under another key"}', "no key 'text' (keys found: body); pass --json-keys KEY"),
    ('["a list"]', "expected a JSON object"),
])
def test_bad_jsonl_names_the_line_and_leaves_no_output(tmp_path, tokenizer_model, line, hint):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a good first line"}\n' + line + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: ") as error:
        preprocess([bad], tmp_path / "out", tokenizer_model, PreprocessConfig(workers=2), log=lambda _: None)
    assert hint in str(error.value) and "\n" not in str(error.value)
    assert list(tmp_path.glob("out*")) == []


def test_a_truncated_bin_is_named_before_training(eod_dataset, tmp_path):
    """A .bin cut short (a copy interrupted) passes the file checks and fails at iteration 1 in
    numpy; the data check compares it with its .idx and names it."""
    prefix = str(tmp_path / "cut_text_document")
    shutil.copyfile(eod_dataset + ".idx", prefix + ".idx")
    data = Path(eod_dataset + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(data)
    check_gpt_data(GPTDataConfig(seq_length=16, blend=([prefix], None), split="100,0,0"))
    Path(prefix + ".bin").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=rf"{prefix}.bin holds {len(data) - 100} bytes, its index {prefix}.idx "
                                         rf"points to {len(data)}: the file is truncated"):
        check_gpt_data(GPTDataConfig(seq_length=16, blend=([prefix], None), split="100,0,0"))


@pytest.mark.parametrize("damage,message", [
    ("cut_idx", r"\.idx holds \d+ bytes, its header announces \d+ sequences and \d+ documents \(\d+ bytes\): the file "
                r"is truncated or damaged; rebuild the pair with tools/preprocess_data.py"),
    ("foreign_idx", r"\.idx is not a Megatron dataset index"),
    ("longer_bin", r"\.bin holds \d+ bytes, its index .*\.idx ends its last document at byte \d+: the two files are "
                   r"not one pair"),
])
def test_a_damaged_or_mismatched_pair_is_named_before_training(eod_dataset, tmp_path, damage, message):
    """A cut .idx made Megatron's reader fail with numpy's "buffer is smaller than requested size"
    (no file named) and then an AttributeError from its __del__; the data check reads the header
    first. A .bin longer than its index says belongs to another dataset."""
    prefix = str(tmp_path / "damaged_text_document")
    index, data = Path(eod_dataset + ".idx").read_bytes(), Path(eod_dataset + ".bin").read_bytes()
    if damage == "cut_idx":
        index = index[: len(index) - 40]
    elif damage == "foreign_idx":
        index = b"PK\x03\x04" + index[4:]
    else:
        data = data + bytes(64)
    Path(prefix + ".idx").write_bytes(index)
    Path(prefix + ".bin").write_bytes(data)
    with pytest.raises(ValueError, match=message) as raised:
        check_gpt_data(GPTDataConfig(seq_length=16, blend=([prefix], None), split="100,0,0"))
    assert "\n" not in str(raised.value)
