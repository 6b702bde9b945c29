#!/usr/bin/env python
"""``pretrain_gpt.py`` recording every QK-clip: each rank saves, per step and layer of its own, the
reduced largest logits of its heads and the part of the ``linear_qkv`` main weight it holds: its
first element and its elements before and after the clip (``<dir>/rank<r>_step<n>.pt``). Launch it in place of the
entry point, with ``QK_CLIP_TRACE=<dir>``; tests/e2e/test_qk_clip.py reads the files."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> int:
    import torch

    import pretrain_gpt
    from canzona_patches.integration import qk_clip
    from megatron.core import parallel_state

    out = Path(os.environ["QK_CLIP_TRACE"])
    out.mkdir(parents=True, exist_ok=True)
    clip = qk_clip.QkClip.clip
    steps = [0]

    def traced(self) -> None:
        before = [None if layer.main is None else layer.main.detach().clone() for layer in self.layers]
        clip(self)
        steps[0] += 1
        torch.save({
            "table": self.table.detach().cpu().clone(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "layers": [{"index": layer.index, "rows": layer.rows, "columns": layer.columns, "start": layer.start,
                        "logits": self.table[row].detach().cpu().clone(),
                        "before": old, "after": None if layer.main is None else layer.main.detach().clone()}
                       for row, (layer, old) in enumerate(zip(self.layers, before))],
        }, out / f"rank{torch.distributed.get_rank()}_step{steps[0]}.pt")

    qk_clip.QkClip.clip = traced
    return pretrain_gpt.main()


if __name__ == "__main__":
    del sys.path[0]  # this file's folder: its neighbours are imported by their package's name
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
