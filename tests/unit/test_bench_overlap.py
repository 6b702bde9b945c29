"""tools/bench_overlap.py --work prep: the side stream's load is the holders' real work on their pieces
(Muon's source, the exact norm, the bf16 packing), and its price is the projection's."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def bench(import_tool):
    return import_tool("bench_overlap")


def test_the_holders_work_packs_each_piece_divided_by_its_own_norm_the_same_each_call(bench):
    work, numel, packed = bench.holder_work(2, 3000, 3, torch.device("cpu"))
    assert numel == 2 * 3 * 1000 == packed.numel() and packed.dtype == torch.bfloat16
    work()
    first = packed.clone()
    norms = first.float().view(6, 1000).norm(dim=1)
    assert torch.allclose(norms, torch.ones(6), atol=1e-2), norms  # bf16 rounding of unit-norm pieces
    work()
    assert torch.equal(packed, first)  # nothing advanced between calls: every repeat times the same work


def test_the_price_printed_beside_it_is_the_projections(bench):
    from megatron.canzona.planning.sim.cluster import load_cluster, preset_path
    from megatron.canzona.planning.sim.step import (EXACT_NORM_BYTES_PER_ELEMENT, NARROW_PACK_BYTES_PER_ELEMENT,
                                                    SOURCE_BYTES_PER_ELEMENT)

    gpu = load_cluster(preset_path("h100-ib400")).gpu
    per_element = SOURCE_BYTES_PER_ELEMENT + EXACT_NORM_BYTES_PER_ELEMENT + NARROW_PACK_BYTES_PER_ELEMENT
    assert bench.priced_ms(10**9) == pytest.approx(1e3 * 1e9 * per_element / gpu.memory_bytes_per_s)
    args = bench.parse_args(["--work", "prep"])
    assert (args.buckets, args.bucket_elements, args.pieces) == (8, bench.DEFAULT_BUCKET_ELEMENTS, 4)
    assert bench.DEFAULT_BUCKET_ELEMENTS == pytest.approx((6144 + 4096 + 24576 + 12288) * 4096 / 64, rel=1e-3)
    with pytest.raises(SystemExit):
        bench.parse_args(["--work", "adamw"])
