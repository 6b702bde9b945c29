"""tools/convert_hf.py: Hugging Face Qwen3 <-> pretrain_gpt.py's torch_dist checkpoints.

One module-scoped sequence of runs (each process pays Megatron's or transformers' imports):

1. ``transformers`` makes two random Qwen3 models: 2 layers, hidden 64, 4 query heads in 2
   key/value groups of head dim 32 (so 4 x 32 != 64, as in real Qwen3), SwiGLU 128,
   vocabulary 512 (the demo tokenizer's), tied and untied embeddings, RMSNorm weights drawn
   from [0.5, 1.5] so that a misplaced norm shows in the logits;
2. ``convert_hf.py import`` writes each as a release checkpoint;
3. ``pretrain_gpt.py`` on 2 gloo ranks with ``--canzona`` (Muon; NorMuon for the untied model), the architecture flags of
   examples/qwen3/common.sh (``qwen3_model_args``) at these sizes, ``--load`` the import:
   the untied model at TP 2 and lr 3e-3, the tied one at PP 2 and lr 0 (its weights must
   come back bitwise); both save iteration 2 with their optimizer state;
4. ``convert_hf.py export`` of both checkpoints, and ``import`` of the untied export;
5. logits of the same tokens: Megatron's (``megatron_logits.py``: each checkpoint loaded by
   Megatron into a TP 1 model) and transformers' (``Qwen3ForCausalLM.from_pretrained``).

A tiny Qwen3-MoE (4 experts of 32, top 2) trains from scratch at TP 2 x EP 2 x expert TP 2 (4
ranks), is exported, and loads as ``Qwen3MoeForCausalLM``.

Megatron's and transformers' fp32 logits agree to ``LOGITS_TOLERANCE``: measured 3.0e-7 to
3.9e-7 for the four pairs, against logits up to 1.5 in magnitude. Mapping mistakes move them
far more: a RoPE base of 1e4 by 0.3, an RMSNorm epsilon of 1e-5 by 9e-3, gate and up swapped
by 4e-2, K and V swapped by 0.97, query heads in the wrong group by 0.43.
"""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from .support import ROOT, VOCAB_SIZE, DemoData, launch_ranks

# The shared sequence runs in the first test's setup: 1.5 minutes of CPU, minutes more on a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CONVERT_TIMEOUT_S = 120
RUN_TIMEOUT_S = 240
LOGITS_TOLERANCE = 1e-4
"""Largest |Megatron - transformers| logit in fp32 (3.9e-7 measured: float32 rounding of the
two implementations' different operation orders)."""
TRACKER = "latest_checkpointed_iteration.txt"
SIZES = {"NUM_LAYERS": 2, "HIDDEN_SIZE": 64, "FFN_HIDDEN_SIZE": 128, "NUM_HEADS": 4, "NUM_QUERY_GROUPS": 2,
         "KV_CHANNELS": 32, "VOCAB_SIZE": VOCAB_SIZE, "SEQ_LENGTH": 64}
RUN_FLAGS_NOT_ARCHITECTURE = ("--seq-length", "--max-position-embeddings", "--init-method-std")
"""common.sh flags that the import does not print: the run's sequence length, and an
initialization that loaded weights override."""
MODELS = ("tied", "untied")
LEARNING_RATE = {"tied": "0", "untied": "3e-3"}
LAYOUT = {"tied": ("--pipeline-model-parallel-size", "2"), "untied": ("--tensor-model-parallel-size", "2")}
"""How the 2-rank run of each model is laid out: the export reads either."""


def recipe_model_args(tied: bool) -> list[str]:
    """``MODEL_ARGS`` of examples/qwen3/common.sh's ``qwen3_model_args`` at :data:`SIZES`."""
    script = 'source examples/qwen3/common.sh && qwen3_model_args && printf "%s\\n" "${MODEL_ARGS[@]}"'
    env = {**os.environ, **{key: str(value) for key, value in SIZES.items()}, "TIED_EMBEDDINGS": str(int(tied))}
    result = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
                            check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def make_hf_model(out: Path, tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=tied)
    torch.manual_seed(int(tied))
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out)


def convert(*args: str) -> subprocess.CompletedProcess:
    return launch_ranks(1, "tools/convert_hf.py", *args, timeout_s=CONVERT_TIMEOUT_S)


def converted(*args: str) -> str:
    result = convert(*args)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


OPTIMIZER = {"tied": ("--optimizer", "muon"),
             "untied": ("--optimizer", "adaptive_muon", "--adaptive-muon-moment2-method", "normuon")}
"""The tied model trains with Muon, the untied one with NorMuon (its checkpoint holds a second
moment besides the momentum; the export reads the weights alone)."""


def train(data: DemoData, out: Path, model: str, load: Path, save: Path) -> str:
    args = [
        *recipe_model_args(model == "tied"), *LAYOUT[model],
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--lr", LEARNING_RATE[model], "--min-lr", "0", "--lr-decay-style", "constant",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "0", "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(data.tokenizer_model), "--data-path", data.data_prefix, "--split", "80,10,10",
        "--data-cache-path", str(out / "cache"), "--num-workers", "0",
        *OPTIMIZER[model], "--canzona", "--use-distributed-optimizer",
        "--load", str(load), "--save", str(save), "--save-interval", "2",
    ]
    result = launch_ranks(2, "pretrain_gpt.py", *args, timeout_s=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-6000:]
    return result.stdout


MOE_FLAGS = ("--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
             "--moe-router-score-function", "softmax", "--moe-router-load-balancing-type", "aux_loss",
             "--moe-aux-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
             "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel")
"""A Qwen3-MoE at TP 2 x EP 2 with Megatron's default expert TP (2): 4 experts of 32 per layer, top 2."""


def train_moe(data: DemoData, out: Path, save: Path) -> str:
    """2 iterations of the mixture from scratch on 4 ranks (Muon, --canzona), saved at iteration 2."""
    args = [
        *recipe_model_args(False), *MOE_FLAGS,
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--lr", "3e-3", "--min-lr", "0", "--lr-decay-style", "constant", "--log-interval", "1",
        "--eval-interval", "1000", "--eval-iters", "0", "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(data.tokenizer_model), "--data-path", data.data_prefix, "--split", "80,10,10",
        "--data-cache-path", str(out / "cache"), "--num-workers", "0",
        "--optimizer", "muon", "--canzona", "--use-distributed-optimizer", "--save", str(save), "--save-interval", "2",
    ]
    result = launch_ranks(4, "pretrain_gpt.py", *args, timeout_s=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-6000:]
    return result.stdout


def checkpoint_weights(load_dir: Path) -> dict[str, torch.Tensor]:
    """The model tensors of the tracked checkpoint, read by torch.distributed.checkpoint alone."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tracked = (load_dir / TRACKER).read_text().strip()
    path = load_dir / (tracked if tracked == "release" else f"iter_{int(tracked):07d}")
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    weights = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in metadata.items()
               if key.startswith(("embedding.", "decoder.", "output_layer.")) and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
        load(weights, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return weights


def hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(hf_dir / "model.safetensors"))


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(tokens).logits.float()


@pytest.fixture(scope="module")
def runs(demo_data: DemoData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("convert_hf")
    out: dict = {"root": root, "tokens": torch.randint(0, VOCAB_SIZE, (2, 48), generator=torch.Generator().manual_seed(0))}
    for model in MODELS:
        hf, imported, trained, exported = (root / f"{model}_{kind}" for kind in ("hf", "imported", "trained", "exported"))
        make_hf_model(hf, tied=model == "tied")
        out[model, "import_log"] = converted("import", "--hf", str(hf), "--save", str(imported))
        out[model, "train_log"] = train(demo_data, root / f"{model}_run", model, imported, trained)
        out[model, "export_log"] = converted("export", "--load", str(trained), "--save", str(exported))
        out[model] = {"hf": hf, "imported": imported, "trained": trained, "exported": exported}
    moe_trained, moe_exported = root / "moe_trained", root / "moe_exported"
    out["moe", "train_log"] = train_moe(demo_data, root / "moe_run", moe_trained)
    out["moe", "export_log"] = converted("export", "--load", str(moe_trained), "--save", str(moe_exported))
    out["moe"] = {"trained": moe_trained, "exported": moe_exported}
    reimported = root / "untied_reimported"
    converted("import", "--hf", str(out["untied"]["exported"]), "--save", str(reimported))
    out["untied"]["reimported"] = reimported

    checkpoints = [str(out[model][kind]) for model in MODELS for kind in ("imported", "trained")]
    checkpoints.append(str(moe_trained))
    torch.save(out["tokens"], root / "tokens.pt")
    result = launch_ranks(1, "tests/e2e/megatron_logits.py", str(root / "tokens.pt"), str(root / "logits.pt"),
                          *checkpoints, timeout_s=CONVERT_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-4000:]
    out["megatron_logits"] = torch.load(root / "logits.pt")
    return out


def _flag_values(words: list[str]) -> dict[str, str | float | None]:
    """``--flag value`` pairs (numbers as floats, so 1e-6 == 1e-06) and bare ``--switch``es."""
    flags: dict[str, str | float | None] = {}
    for index, word in enumerate(words):
        if word.startswith("--"):
            value = words[index + 1] if index + 1 < len(words) and not words[index + 1].startswith("--") else None
            try:
                flags[word] = float(value) if value is not None else None
            except ValueError:
                flags[word] = value
    return flags


@pytest.mark.parametrize("model", MODELS)
def test_import_prints_the_recipe_architecture_flags(runs: dict, model: str) -> None:
    """The flags the import derives from a Qwen3 config are examples/qwen3/common.sh's, and the
    2-rank runs train with those (so the recipe's flags are Qwen3's: the logits tests check it)."""
    printed = next(line for line in runs[model, "import_log"].splitlines() if line.startswith("--num-layers"))
    recipe = _flag_values(recipe_model_args(model == "tied"))
    for flag in RUN_FLAGS_NOT_ARCHITECTURE:
        recipe.pop(flag)
    assert _flag_values(printed.split()) == recipe


@pytest.mark.parametrize("model", MODELS)
def test_imported_checkpoint_computes_the_hf_logits(runs: dict, model: str) -> None:
    megatron = runs["megatron_logits"][str(runs[model]["imported"])]
    reference = hf_logits(runs[model]["hf"], runs["tokens"])
    assert megatron.shape == reference.shape == (*runs["tokens"].shape, VOCAB_SIZE)
    assert reference.abs().max() > 0.5  # not a degenerate model
    assert (megatron - reference).abs().max() <= LOGITS_TOLERANCE


@pytest.mark.parametrize("model", MODELS)
def test_export_of_a_tp2_or_pp2_checkpoint_computes_megatrons_logits(runs: dict, model: str) -> None:
    megatron = runs["megatron_logits"][str(runs[model]["trained"])]
    exported = hf_logits(runs[model]["exported"], runs["tokens"])
    assert (megatron - exported).abs().max() <= LOGITS_TOLERANCE


def test_export_of_a_mixture_at_expert_tp_2_computes_megatrons_logits(runs: dict) -> None:
    """A Qwen3-MoE trained at TP 2 x EP 2 x expert TP 2 exports as ``Qwen3MoeForCausalLM`` (the router
    as ``mlp.gate``, each expert's fc1 as its gate and up projections by global index), whose logits
    are Megatron's (measured 1.8e-7 by hand)."""
    transformers = pytest.importorskip("transformers")
    assert "saved at TP 2 x PP 1 x DP 2 x EP 2 x expert TP 2): Qwen3-MoE" in runs["moe", "export_log"]
    config = json.loads((runs["moe"]["exported"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (4, 2, 32)
    assert config["norm_topk_prob"] is True
    names = hf_weights(runs["moe"]["exported"])
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.3.gate_proj.weight",
            "model.layers.1.mlp.experts.3.down_proj.weight"} <= names.keys()
    model = transformers.AutoModelForCausalLM.from_pretrained(runs["moe"]["exported"], dtype=torch.float32,
                                                              attn_implementation="eager")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        exported = model.eval()(runs["tokens"]).logits.float()
    megatron = runs["megatron_logits"][str(runs["moe"]["trained"])]
    assert megatron.shape == exported.shape
    assert (megatron - exported).abs().max() <= LOGITS_TOLERANCE


def test_pp2_run_loads_the_import_and_saves_it_back_bitwise(runs: dict) -> None:
    """At lr 0 the run's weights stay the imported ones: HF -> import -> PP 2 load and save ->
    export gives back every tensor of the original Hugging Face model bit for bit."""
    assert "loading release distributed checkpoint" in runs["tied", "train_log"]
    original, exported = hf_weights(runs["tied"]["hf"]), hf_weights(runs["tied"]["exported"])
    assert original.keys() == exported.keys() and "lm_head.weight" not in exported
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name


def test_tp2_run_continues_from_the_import(runs: dict) -> None:
    """At lr 3e-3 two Muon steps move every matrix a little; a run that ignored the import
    would start from fresh weights (norm weights of 1 instead of [0.5, 1.5])."""
    original, exported = hf_weights(runs["untied"]["hf"]), hf_weights(runs["untied"]["exported"])
    assert original.keys() == exported.keys() and "lm_head.weight" in exported
    moved = {name: float((exported[name] - tensor).abs().max()) for name, tensor in original.items()}
    assert max(moved.values()) < 0.05, moved
    assert moved["model.layers.0.self_attn.q_proj.weight"] > 0 and moved["lm_head.weight"] > 0


def test_export_then_import_gives_back_the_checkpoint_weights_bitwise(runs: dict) -> None:
    saved = checkpoint_weights(runs["untied"]["trained"])
    reimported = checkpoint_weights(runs["untied"]["reimported"])
    assert saved.keys() == reimported.keys() and "output_layer.weight" in saved
    for key, tensor in saved.items():
        assert torch.equal(tensor, reimported[key]), key


def test_exported_directory_is_a_qwen3_model(runs: dict) -> None:
    config = json.loads((runs["tied"]["exported"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert (config["vocab_size"], config["head_dim"], config["num_key_value_heads"]) == (VOCAB_SIZE, 32, 2)
    assert (config["rope_theta"], config["rms_norm_eps"], config["tie_word_embeddings"]) == (1000000.0, 1e-6, True)
    assert "exported 131,520 parameters (float32)" in runs["tied", "export_log"]
    tracker = (runs["tied"]["imported"] / TRACKER).read_text()
    assert tracker == "release" and (runs["tied"]["imported"] / "release" / ".metadata").is_file()


# --- bad input (every message is checked in-process by tests/unit/test_hf_qwen3.py) ------------


def _non_qwen3_hf_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    return path


@pytest.mark.parametrize("command", ["export", "import"])
def test_bad_input_exits_2_with_one_line(tmp_path: Path, command: str) -> None:
    if command == "export":
        args, fix = ["export", "--load", str(tmp_path), "--save", str(tmp_path / "hf")], "not a Megatron checkpoint"
    else:
        args, fix = ["import", "--hf", str(_non_qwen3_hf_dir(tmp_path / "llama")), "--save", str(tmp_path / "ckpt")], \
            "only Qwen3 dense models"
    result = convert(*args)
    errors = [line for line in result.stdout.splitlines() if "convert_hf.py: error:" in line]
    assert result.returncode == 2, result.stdout[-2000:]
    assert len(errors) == 1 and fix in errors[0], result.stdout[-2000:]
