"""pretrain_gpt.py's data flags, built in-process: blends, per-split paths, data args files, mock data.

Flags go through Megatron's own parser, ``pretrain_gpt.data_config_from_args`` and
``build_gpt_datasets``, as the provider takes them, without starting a run. Two tiny
indexed datasets tell their samples apart by token range: ``alpha`` holds ids 0-99 and
``beta`` ids 100-199 (EOD is 255, NullTokenizer's last id).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from canzona_patches.integration.arguments import add_canzona_args
from megatron.canzona.data import GPTDataConfig, build_gpt_datasets, describe_datasets

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import pretrain_gpt  # noqa: E402

VOCAB_SIZE = 256
EOD = VOCAB_SIZE - 1
SEQ_LENGTH = 16
RANGES = {"alpha": (0, 100), "beta": (100, 200)}


def write_dataset(prefix: Path, documents: list[np.ndarray]) -> str:
    """An indexed dataset of ``documents`` (one sequence each), as tools/preprocess_data.py writes."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for ids in documents:
        builder.add_document(ids, [ids.size])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def random_documents(rng: np.random.Generator, count: int, low: int, high: int) -> list[np.ndarray]:
    return [np.append(rng.integers(low, high, size=int(rng.integers(20, 60))), EOD).astype(np.int64)
            for _ in range(count)]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Prefixes: alpha (40 documents), beta (60), tiny (3: too few for --split 949,50,1), empty (0)."""
    out = tmp_path_factory.mktemp("blends")
    rng = np.random.default_rng(0)
    return {
        "alpha": write_dataset(out / "alpha", random_documents(rng, 40, *RANGES["alpha"])),
        "beta": write_dataset(out / "beta", random_documents(rng, 60, *RANGES["beta"])),
        "tiny": write_dataset(out / "tiny", random_documents(rng, 3, *RANGES["alpha"])),
        "empty": write_dataset(out / "empty", []),
    }


def parse(*flags: str) -> argparse.Namespace:
    from megatron.training.arguments import add_megatron_arguments

    parser = add_canzona_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    return parser.parse_args(["--seq-length", str(SEQ_LENGTH), "--tokenizer-type", "NullTokenizer",
                              "--vocab-size", str(VOCAB_SIZE), *flags])


@pytest.fixture(scope="module")
def tokenizer():
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    args = parse()
    args.pad_vocab_size = False  # padding reads the rank, which only validate_args sets
    return build_tokenizer(args)


def build(tokenizer, tmp_path: Path, *flags: str, num_samples: tuple[int, int, int] = (100, 20, 20)) -> list:
    args = parse(*flags, "--data-cache-path", str(tmp_path / "cache"))
    return build_gpt_datasets(pretrain_gpt.data_config_from_args(args), tokenizer, num_samples)


def origin(tokens: np.ndarray) -> str:
    """Which dataset all of a sample's non-EOD tokens come from."""
    ids = tokens[tokens != EOD]
    names = [name for name, (low, high) in RANGES.items() if ((ids >= low) & (ids < high)).all()]
    assert len(names) == 1, f"tokens from both datasets: {tokens}"
    return names[0]


def tokens_of(dataset) -> list[list[int]]:
    return [dataset[i]["tokens"].tolist() for i in range(len(dataset))]


def test_one_prefix_gives_the_samples_it_gave_before(data, tokenizer, tmp_path):
    """One --data-path prefix is built by the builder call pretrain_gpt.py made before blends."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    datasets = build(tokenizer, tmp_path / "new", "--data-path", data["alpha"], "--split", "80,10,10")
    before = GPTDatasetConfig(
        random_seed=1234, sequence_length=SEQ_LENGTH, blend=([data["alpha"]], None), split="80,10,10",
        path_to_cache=str(tmp_path / "before"), tokenizer=tokenizer, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=True)
    reference = BlendedMegatronDatasetBuilder(GPTDataset, [100, 20, 20], lambda: True, before).build()
    for dataset, expected in zip(datasets, reference):
        assert type(dataset) is GPTDataset
        assert tokens_of(dataset) == tokens_of(expected)
    shorthand = build_gpt_datasets(GPTDataConfig(data_prefix=data["alpha"], seq_length=SEQ_LENGTH, split="80,10,10",
                                                 cache_dir=str(tmp_path / "short")), tokenizer, (100, 20, 20))
    assert tokens_of(shorthand[0]) == tokens_of(reference[0])


def test_a_weighted_blend_draws_each_dataset_by_its_weight(data, tokenizer, tmp_path):
    from megatron.core.datasets.blended_dataset import BlendedDataset

    datasets = build(tokenizer, tmp_path, "--data-path", "0.3", data["alpha"], "0.7", data["beta"],
                     "--split", "80,10,10")
    for dataset, size in zip(datasets, (100, 20, 20)):
        assert isinstance(dataset, BlendedDataset) and dataset.weights == pytest.approx([0.3, 0.7])
        assert [part.dataset_path for part in dataset.datasets] == [data["alpha"], data["beta"]]
        assert np.bincount(dataset.dataset_index).tolist() == [round(0.3 * size), round(0.7 * size)]
    train = datasets[0]
    for i in range(len(train)):  # each sample comes whole from the dataset the blend names
        sample = train[i]
        assert origin(sample["tokens"].numpy()) == ("alpha", "beta")[int(sample["dataset_id"])]
    assert describe_datasets(datasets)[0] == (
        f"train: 100 samples, blend of 2: 30 from {data['alpha']} (weight 0.300), "
        f"70 from {data['beta']} (weight 0.700)")


def test_a_blend_without_weights_follows_the_dataset_sizes(data, tokenizer, tmp_path):
    train = build(tokenizer, tmp_path, "--data-path", data["alpha"], data["beta"], "--split", "80,10,10")[0]
    sizes = [len(part) for part in train.datasets]
    assert train.weights == pytest.approx([size / sum(sizes) for size in sizes])
    assert sizes[1] > sizes[0]  # beta holds more documents


def test_each_split_from_its_own_paths(data, tokenizer, tmp_path):
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.gpt_dataset import GPTDataset

    train, valid, test = build(tokenizer, tmp_path, "--train-data-path", "0.5", data["alpha"], "0.5", data["beta"],
                               "--valid-data-path", data["beta"], "--test-data-path", data["alpha"])
    assert isinstance(train, BlendedDataset) and train.weights == pytest.approx([0.5, 0.5])
    # A split's own dataset is used whole: every document, no --split cut.
    assert type(valid) is GPTDataset and valid.dataset_path == data["beta"]
    assert sorted(set(valid.indices.tolist())) == list(range(60))
    assert {origin(np.array(t)) for t in tokens_of(valid)} == {"beta"}
    assert type(test) is GPTDataset and sorted(set(test.indices.tolist())) == list(range(40))
    only_train = build(tokenizer, tmp_path / "train_only", "--train-data-path", data["beta"])
    assert only_train[0].dataset_path == data["beta"] and only_train[1:] == [None, None]


@pytest.mark.quick
def test_a_data_args_file_is_the_same_as_its_flags(data, tokenizer, tmp_path):
    listing = tmp_path / "data_args.txt"
    listing.write_text(f"0.3 {data['alpha']}\n0.7 {data['beta']}\n")
    from_file = build(tokenizer, tmp_path / "file", "--data-args-path", str(listing), "--split", "80,10,10")
    from_flags = build(tokenizer, tmp_path / "flags", "--data-path", "0.3", data["alpha"], "0.7", data["beta"],
                       "--split", "80,10,10")
    for a, b in zip(from_file, from_flags):
        assert a.weights == b.weights and (a.dataset_index == b.dataset_index).all()
        assert tokens_of(a) == tokens_of(b)
    # Without --split it gets the split validate_args gives --data-path without one.
    config = pretrain_gpt.data_config_from_args(parse("--data-args-path", str(listing)))
    assert config.split == "969, 30, 1"


def test_a_per_split_data_args_file_is_the_same_as_its_flags(data, tokenizer, tmp_path):
    listing = tmp_path / "per_split.json"
    listing.write_text(json.dumps({"train": f"0.5 {data['alpha']} 0.5 {data['beta']}",
                                   "valid": [data["beta"]], "test": data["alpha"]}))
    from_file = build(tokenizer, tmp_path / "file", "--per-split-data-args-path", str(listing))
    from_flags = build(tokenizer, tmp_path / "flags", "--train-data-path", "0.5", data["alpha"], "0.5", data["beta"],
                       "--valid-data-path", data["beta"], "--test-data-path", data["alpha"])
    for a, b in zip(from_file, from_flags):
        assert tokens_of(a) == tokens_of(b)


def test_mock_data_needs_no_files(tokenizer, tmp_path):
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    datasets = build(tokenizer, tmp_path, "--mock-data", num_samples=(8, 4, 4))
    assert [type(d) for d in datasets] == [MockGPTDataset] * 3
    tokens = datasets[0][0]["tokens"]
    assert tokens.shape == (SEQ_LENGTH,) and int(tokens.max()) < VOCAB_SIZE
    assert describe_datasets(datasets)[1] == f"validation: {len(datasets[1])} mock samples"


def test_position_ids_restart_after_each_document_when_asked(data, tokenizer, tmp_path):
    train = build(tokenizer, tmp_path, "--data-path", data["alpha"], "--split", "80,10,10",
                  "--reset-position-ids")[0]
    for i in range(len(train)):
        sample = train[i]
        eods = np.flatnonzero(sample["tokens"].numpy() == EOD)
        if eods.size and eods[0] < SEQ_LENGTH - 1:
            assert int(sample["position_ids"][eods[0] + 1]) == 0
            return
    pytest.fail("no sample with a document boundary inside it")


BAD_FLAGS = {
    "split_empty_for_one_prefix_of_a_blend": (["--data-path", "0.5", "{alpha}", "0.5", "{tiny}", "--split", "80,10,10"],
                                              "--split 80,10,10 leaves the test split of {tiny} (3 documents)"),
    "per_split_dataset_without_documents": (["--train-data-path", "{alpha}", "--valid-data-path", "{empty}"],
                                            "--valid-data-path {empty} holds no tokens"),
    "missing_prefix_in_a_blend": (["--data-path", "0.5", "{alpha}", "0.5", "{alpha}_nope", "--split", "8,1,1"],
                                  "{alpha}_nope.bin not found"),
    "zero_weight": (["--data-path", "0", "{alpha}", "1", "{beta}", "--split", "8,1,1"], "weights must be positive"),
    "split_with_per_split_paths": (["--train-data-path", "{alpha}", "--split", "8,1,1"], "drop --split"),
    "no_data": ([], "no data given: pass --data-path"),
    "path_flag_without_a_path": (["--valid-data-path", "--train-data-path", "{alpha}"],
                                 "--valid-data-path names no dataset"),
    "mock_and_paths": (["--mock-data", "--data-path", "{alpha}"], "--data-path and --mock-data each name the data"),
    "missing_data_args_file": (["--data-args-path", "{alpha}.txt"], "cannot read the data args file"),
    "per_split_file_without_test": (["--per-split-data-args-path", "{per_split}"], "'test' is missing"),
}


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_bad_data_flags_name_the_fix(data, tokenizer, tmp_path, case):
    per_split = tmp_path / "per_split.json"
    per_split.write_text(json.dumps({"train": data["alpha"], "valid": data["beta"]}))
    flags, message = BAD_FLAGS[case]
    paths = {**data, "per_split": str(per_split)}
    with pytest.raises(ValueError, match=re.escape(message.format(**paths))):
        build(tokenizer, tmp_path, *(flag.format(**paths) for flag in flags))
