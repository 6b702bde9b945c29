"""Every Canzona flag does something in the run it is given, or is refused in one line.

The flag tables are generated from the argument groups ``add_canzona_args`` builds (``canzona``,
``canzona shampoo``, ...), so a flag added to a group later is covered without a list to keep:
without ``--canzona`` each flag of the ``canzona`` group is refused, but those that act on every
run (``EVERY_RUN_FLAGS``); each optimizer's flags need that optimizer. Then the combinations in
which a mode turns a feature off, Megatron's choice-like flags that its parser leaves unchecked,
and the files named on the command line (the Newton-Schulz calibration, the tokenizer model),
each checked at parse time with a line naming the file and the fix.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from canzona_patches.integration.arguments import (
    EVERY_RUN_FLAGS,
    MATRIX_FLAG_OWNERS,
    CanzonaArgumentError,
    add_canzona_args,
    flag_groups,
    validate_canzona_args,
)
from canzona_patches.integration.dependent_flags import DEPENDENT_FLAGS

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "10", "--lr", "1e-3", "--eval-interval", "5"]
CANZONA = ["--canzona", "--optimizer", "muon", "--use-distributed-optimizer"]
SHIPPED_CALIBRATION = str(ROOT / "tools" / "calibrations" / "h100-muon-bf16.json")
STRING_VALUES = {"canzona_cluster": "h100-ib400", "canzona_calibration": SHIPPED_CALIBRATION}
"""Values of the string flags that pass their own checks (the others take a path under tmp)."""


def parse(*flags: str) -> argparse.Namespace:
    from megatron.training.arguments import add_megatron_arguments

    parser = add_canzona_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    return parser.parse_args([*BASE, *flags])


def non_default_words(actions: tuple[argparse.Action, ...]) -> dict[str, list[str]]:
    """Each flag of ``actions`` as command-line words that give its ``dest`` a value other than
    its default (a switch whose constant is the default gives none: it cannot be told apart)."""
    words: dict[str, list[str]] = {}
    defaults: dict[str, object] = {}
    for action in actions:
        flag = action.option_strings[0]
        default = defaults.setdefault(action.dest, action.default)  # a switch pair's: the first's
        if action.nargs == 0:
            if action.const != default:
                words[flag] = [flag]
        elif action.choices:
            words[flag] = [flag, next(str(c) for c in action.choices if c != default)]
        elif action.type in (int, float):
            words[flag] = [flag, str(action.type((default or 0) + 1))]
        else:
            words[flag] = [flag, STRING_VALUES.get(action.dest, "{tmp}/" + action.dest)]
    return words


CANZONA_FLAGS = {flag: words for flag, words in non_default_words(flag_groups()["canzona"]).items()
                 if flag != "--canzona"}
MATRIX_FLAGS = {(optimizer, flag): words for optimizer in MATRIX_FLAG_OWNERS
                for flag, words in non_default_words(flag_groups()[f"canzona {optimizer}"]).items()}


def in_tmp(words: list[str], tmp_path: Path) -> list[str]:
    return [w.replace("{tmp}", str(tmp_path)) for w in words]


def test_the_tables_are_the_groups() -> None:
    """Every flag of the group has a value that is not its default (the switch back to a default
    aside), and the every-run list names flags of the group."""
    group = {a.option_strings[0] for a in flag_groups()["canzona"]}
    assert set(EVERY_RUN_FLAGS) <= group
    back_to_default = group - set(CANZONA_FLAGS)
    assert back_to_default <= {"--canzona", "--canzona-split-qkv", "--canzona-no-split-gate-up",
                               "--canzona-stagger-refresh", "--canzona-early-gather", "--canzona-checksums",
                               "--canzona-no-narrow-gathers"}
    assert len(CANZONA_FLAGS) >= 20 and len(MATRIX_FLAGS) >= 20


@pytest.mark.parametrize("flag", sorted(set(CANZONA_FLAGS) - set(EVERY_RUN_FLAGS)))
def test_a_canzona_flag_without_canzona_is_refused_in_one_line(flag: str, tmp_path: Path) -> None:
    words = in_tmp(CANZONA_FLAGS[flag], tmp_path)
    with pytest.raises(CanzonaArgumentError, match=f"^{flag}.* does nothing without --canzona") as refused:
        validate_canzona_args(parse(*words))
    assert "\n" not in str(refused.value) and f"add --canzona" in str(refused.value)
    # with --canzona the same words are not refused for it (another check may still answer them)
    try:
        validate_canzona_args(parse(*CANZONA, *words))
    except CanzonaArgumentError as error:
        assert "does nothing without --canzona" not in str(error)


@pytest.mark.parametrize("flag", sorted(set(CANZONA_FLAGS) & set(EVERY_RUN_FLAGS)))
def test_a_flag_of_every_run_is_taken_without_canzona(flag: str, tmp_path: Path) -> None:
    words = in_tmp(CANZONA_FLAGS[flag], tmp_path)
    if flag == "--canzona-profile-file":  # it writes what the profiled iteration measured
        words += ["--canzona-profile-iteration", "2"]
    switch = {entry.flag: entry.switch_words for entry in DEPENDENT_FLAGS}.get(flag, ())
    args = parse(*words, *in_tmp(list(switch), tmp_path))  # a flag of a switch (--save) with it
    validate_canzona_args(args)
    assert args.canzona is False


@pytest.mark.parametrize(("optimizer", "flag"), sorted(MATRIX_FLAGS))
def test_an_optimizers_flag_needs_that_optimizer(optimizer: str, flag: str) -> None:
    words = MATRIX_FLAGS[optimizer, flag]
    other = "muon" if optimizer != "muon" else "soap"
    with pytest.raises(CanzonaArgumentError, match=f"^{flag} .*: pass --optimizer {optimizer}, or drop {flag}$"):
        validate_canzona_args(parse("--optimizer", other, "--canzona", "--use-distributed-optimizer", *words))
    try:
        validate_canzona_args(parse("--optimizer", optimizer, "--canzona", "--use-distributed-optimizer", *words))
    except CanzonaArgumentError as error:
        assert "pass --optimizer" not in str(error)


@pytest.mark.parametrize(("flags", "message"), [
    # a feature a mode turns off: refused, as --canzona-early-compute with --canzona-no-early-gather
    (["--canzona-tp-mode", "sync", "--canzona-early-compute"],
     "--canzona-early-compute computes each micro-group where its early gather lands: drop --canzona-tp-mode sync"),
    (["--canzona-tp-mode", "sync", "--canzona-matrices-reduce-first", "--overlap-grad-reduce"],
     "--canzona-matrices-reduce-first reorders the reduce-scatters for early compute: drop --canzona-tp-mode sync"),
    (["--canzona-no-early-compute", "--canzona-early-compute-budget", "3"],
     "--canzona-early-compute-budget 3.0 bounds what early compute keeps, and --canzona-no-early-compute turns"),
    (["--canzona-no-early-gather", "--canzona-early-compute-budget", "0"], "--canzona-no-early-gather turns"),
    (["--canzona-no-stagger-refresh"], "--canzona-no-stagger-refresh times Shampoo's and SOAP's"),
    (["--canzona-split-qkv-per-head", "--canzona-no-split-qkv"],
     "--canzona-split-qkv-per-head splits Q, K and V into their heads, and --canzona-no-split-qkv keeps"),
    (["--canzona-calibration", SHIPPED_CALIBRATION],
     "serves --optimizer muon --muon-ns-method auto \\(this run: --optimizer muon --muon-ns-method standard\\)"),
    (["--canzona-calibration", "none", "--muon-ns-method", "gram"], "serves --optimizer muon --muon-ns-method auto"),
    (["--canzona-calibration", SHIPPED_CALIBRATION, "--muon-ns-method", "auto", "--muon-fp32-matmul-prec", "high"],
     "timed Newton-Schulz in bfloat16, this run iterates in float32 \\(--muon-fp32-matmul-prec high\\)"),
    # Megatron's Muon flags that --canzona does not read
    (["--muon-tp-mode", "duplicated"], "--muon-tp-mode sets Megatron's layer-wise Muon, which --canzona replaces"),
    (["--muon-no-split-qkv"], "--muon-no-split-qkv .*Canzona reads --canzona-no-split-qkv"),
    (["--muon-scalar-optimizer", "lion"], "--muon-scalar-optimizer sets Megatron's layer-wise Muon"),
    # Megatron's choice-like flags its parser leaves unchecked
    (["--muon-coefficient-type", "quintik"], "--muon-coefficient-type quintik is not a Newton-Schulz coefficient set"),
    (["--cp-comm-type", "ring"], "--cp-comm-type ring is not a context-parallel communication type: pass p2p, a2a"),
    (["--cp-comm-type", "p2p", "a2a", "p2p"], "--cp-comm-type gives 3 types for --num-layers 2"),
    (["--canzona-profile-file", "/tmp/profile.json"], "--canzona-profile-file writes the profile of"),
])
def test_a_flag_the_run_would_not_read_is_refused(flags: list[str], message: str) -> None:
    with pytest.raises(CanzonaArgumentError, match=message) as refused:
        validate_canzona_args(parse(*CANZONA, *flags))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("flags", [
    ["--canzona-tp-mode", "sync"],  # early compute auto: off by the mode, said at start-up
    ["--canzona-calibration", SHIPPED_CALIBRATION, "--muon-ns-method", "auto"],
    ["--canzona-calibration", "none", "--muon-ns-method", "auto"],
    ["--cp-comm-type", "a2a"], ["--cp-comm-type", "p2p", "all_gather"],
    ["--muon-coefficient-type", "polar_express"],
])
def test_the_same_flags_where_the_run_reads_them_pass(flags: list[str]) -> None:
    validate_canzona_args(parse(*CANZONA, *flags))


CALIBRATIONS = {
    "not_json": ("{'muon_methods': }", "not valid JSON"),
    "a_list": ("[]", "expected an object with 'ns_dtype' and 'muon_methods', got list"),
    "bench_optim_without_methods": (json.dumps({"optimizer": "muon", "ns_dtype": "bfloat16", "timings": []}),
                                    "muon_methods must hold the timings of standard and gram; it has none"),
    "one_method": (json.dumps({"ns_dtype": "bfloat16", "muon_methods": {"standard": {}}}),
                   "muon_methods must hold the timings of standard and gram; got \\['standard'\\]"),
    "ns_dtype_fp16": (json.dumps({"ns_dtype": "float16", "muon_methods": {"standard": {}, "gram": {}}}),
                      "ns_dtype must be one of bfloat16, float32, got 'float16'"),
    "seconds_a_string": (json.dumps({"ns_dtype": "bfloat16", "muon_methods": {
        m: {"optimizer": "muon", "timings": [{"m": 8, "n": 8, "seconds": "0.1"}]} for m in ("standard", "gram")}}),
        "muon_methods.standard: timings\\[0\\].seconds must be a positive number, got '0.1'"),
}


@pytest.mark.parametrize("case", sorted(CALIBRATIONS))
def test_a_calibration_is_read_when_named(case: str, tmp_path: Path) -> None:
    text, what = CALIBRATIONS[case]
    path = tmp_path / f"{case}.json"
    path.write_text(text)
    # (the file named once: the reader's own "<name>: " prefix is dropped)
    with pytest.raises(CanzonaArgumentError, match=f"^--canzona-calibration {path}: {what}") as refused:
        validate_canzona_args(parse(*CANZONA, "--muon-ns-method", "auto", "--canzona-calibration", str(path)))
    assert "\n" not in str(refused.value) and "tools/bench_optim.py" in str(refused.value)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece model and its ``.vocab``, trained on a page of a shipped book (~0.5 s)."""
    from megatron.canzona.data import TokenizerTrainConfig, train_sentencepiece

    text = (ROOT / "data" / "books" / "austen-emma.txt").read_text()[:200_000].split("\n\n")
    return train_sentencepiece(text, tmp_path_factory.mktemp("tokenizer") / "books",
                               TokenizerTrainConfig(vocab_size=400, num_threads=1), log=lambda line: None)


def test_a_sentencepiece_model_loads(tokenizer: Path) -> None:
    validate_canzona_args(parse("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tokenizer)))


@pytest.mark.parametrize(("named", "what"), [
    ("books.vocab", "is not a SentencePiece model \\(.*\\); --tokenizer-type GPTSentencePieceTokenizer loads a "
                    "SentencePiece .model file: pass {model}$"),
    (".", "is a directory; .*: pass {model}$"),
])
def test_a_sibling_of_the_tokenizer_says_which_file_to_pass(tokenizer: Path, named: str, what: str) -> None:
    path = tokenizer.parent / named
    with pytest.raises(CanzonaArgumentError, match=f"^--tokenizer-model {path} {what.format(model=tokenizer)}"):
        validate_canzona_args(parse("--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(path)))


def test_a_hugging_face_tokenizer_file_is_sent_to_its_directory(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CanzonaArgumentError, match=f"HuggingFaceTokenizer loads its directory: pass {tmp_path}$"):
        validate_canzona_args(parse("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                    str(tmp_path / "tokenizer.json")))
