"""Megatron's logits of torch_dist checkpoints, each loaded whole into this one CPU process.

    python tests/e2e/megatron_logits.py TOKENS.pt OUT.pt CKPT_DIR [CKPT_DIR ...]

For every checkpoint: the GPTModel that pretrain_gpt.py builds from the arguments saved in
it, at TP 1 and PP 1, filled with NaN, then loaded by Megatron's ``dist_checkpointing``
(which reshards a TP 2 or PP 2 save) and run on the tokens (``[batch, seq]`` int64). OUT.pt maps
each directory to its fp32 logits ``[batch, seq, vocab]``. Only Megatron reads the
checkpoint here, so these logits do not depend on the converter's mapping.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _converter():
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "tools" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def megatron_logits(convert_hf, load_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core import dist_checkpointing

    path = convert_hf.checkpoint_dir(load_dir, None)
    args = convert_hf.one_process_args(convert_hf.read_megatron_args(path))
    model = convert_hf.build_megatron_model(args)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))  # a weight the load missed shows up as NaN logits
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=convert_hf.sharded_metadata())}, str(path))
    model.load_state_dict(loaded["model"], strict=True)
    model.eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None).float()


def main(argv: list[str]) -> int:
    tokens_file, out_file, *load_dirs = argv
    tokens = torch.load(tokens_file)
    convert_hf = _converter()
    logits = {load_dir: megatron_logits(convert_hf, Path(load_dir), tokens) for load_dir in load_dirs}
    torch.save(logits, out_file)
    convert_hf.end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
