"""Newton-Schulz of a matrix cut in blocks along its long side, each block on its own rank.

Ranks are threads here: each runs :func:`newton_schulz` on its block and the reduce sums every
rank's tensor in rank order and hands each the same sum, as an all-reduce does. The blocks'
results, put together, must be the whole matrix's single-device result.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron.canzona.optim import newton_schulz, singular_value_band
from megatron.canzona.optim.config import MuonConfig
from megatron.canzona.optim.muon import MuonState, muon_update
from megatron.canzona.optim.newton_schulz import spectrum_matrix
from megatron.canzona.planning.cost import ns_flops, ns_method_for

# fp64: the blocks' Gram matrices summed in another order than one product's (seen <2e-12
# over the fp64 cases below).
BLOCKS_FP64_ATOL = 1e-10
# fp32, over the same cases: standard seen <8e-6; gram <8e-4 (Polar Express on the
# ill-conditioned input, whose accumulated polynomial amplifies the rounding, as single-device
# gram does: tests/unit/test_optim_newton_schulz.py).
BLOCKS_FP32_ATOL = {"standard": 1e-4, "gram": 2e-3}
# bf16: each block's Gram product is rounded to bf16 before the sum: the band holds with the
# slack of the single-device method (tests/unit/test_optim_newton_schulz.py).
BLOCKS_BAND_SLACK_BF16 = 0.15


class ThreadReduce:
    """An all-reduce (sum) over ``size`` threads: every call blocks until all have called."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls = [0] * size
        self._parts: list[torch.Tensor | None] = [None] * size
        self._sum: torch.Tensor | None = None
        self._barrier = threading.Barrier(size)

    def of(self, rank: int):
        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            self._parts[rank] = tensor
            if self._barrier.wait() == 0:
                total = self._parts[0].clone()
                for part in self._parts[1:]:
                    total += part
                self._sum = total
            self._barrier.wait()
            out = self._sum.clone()
            self._barrier.wait()
            return out
        return reduce


def on_threads(parts: int, work) -> tuple[list, ThreadReduce]:
    """``work(rank, reduce)`` on ``parts`` threads at once; their results, in rank order."""
    reducer = ThreadReduce(parts)
    out: list = [None] * parts
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = work(rank, reducer.of(rank))
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)
            reducer._barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out, reducer


def run_blocks(x: torch.Tensor, parts: int, **kwargs) -> tuple[torch.Tensor, ThreadReduce]:
    """``newton_schulz`` of ``x`` (…, m, n) cut into ``parts`` blocks along its long side, one
    thread per block; the blocks' results put back together."""
    rows, cols = x.shape[-2:]
    dim = -2 if rows > cols else -1
    blocks = x.tensor_split(parts, dim=dim)
    out, reducer = on_threads(parts, lambda r, reduce: newton_schulz(blocks[r], shape=(rows, cols), reduce=reduce, **kwargs))
    return torch.cat(out, dim=dim), reducer


SHAPES = [(16, 160), (160, 16), (24, 72), (32, 48)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("kind", ["random", "ill", "rank_deficient"])
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
@pytest.mark.parametrize("parts", [2, 4])
def test_blocks_equal_the_whole_matrix_in_fp64(shape, method, kind, coefficients, parts):
    x = spectrum_matrix(*shape, kind, seed=5)
    whole = newton_schulz(x, coefficients=coefficients, dtype=torch.float64, method=method)
    blocks, reducer = run_blocks(x, parts, coefficients=coefficients, dtype=torch.float64, method=method)
    assert float((blocks - whole).abs().max()) < BLOCKS_FP64_ATOL
    # One reduce for the norm, then one per Gram matrix: every step (standard), every run (gram).
    assert reducer.calls == [1 + (5 if method == "standard" else 1)] * parts


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_blocks_of_a_stack_in_fp32(method):
    x = torch.stack([spectrum_matrix(16, 96, kind, seed=6) for kind in ("random", "ill", "rank_deficient")]).float()
    whole = newton_schulz(x, dtype=torch.float32, method=method)
    blocks, _ = run_blocks(x, 3, dtype=torch.float32, method=method)
    assert blocks.dtype == torch.float32 and blocks.shape == x.shape
    assert float((blocks - whole).abs().max()) < BLOCKS_FP32_ATOL[method]


@pytest.mark.parametrize("shape", [(16, 160), (160, 16)])
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("kind", ["random", "ill", "rank_deficient"])
def test_blocks_keep_the_singular_values_in_the_band_in_bf16(shape, method, kind):
    x = spectrum_matrix(*shape, kind, seed=7)
    s_in = torch.linalg.svdvals(x) / torch.linalg.matrix_norm(x)
    nonzero = s_in[s_in > 1e-10]
    low, high = singular_value_band("quintic", 5, lower=float(nonzero.min()), upper=float(nonzero.max()))
    blocks, reducer = run_blocks(x, 4, dtype=torch.bfloat16, method=method)
    s_out = torch.linalg.svdvals(blocks.double())[: len(nonzero)]
    slack = BLOCKS_BAND_SLACK_BF16
    assert low - slack <= float(s_out.min()) and float(s_out.max()) <= high + slack
    # bf16 gram restarts every 2 steps: runs of 2, 2 and 1, one Gram matrix each.
    assert reducer.calls == [1 + (5 if method == "standard" else 3)] * 4


def test_a_block_must_be_cut_along_the_long_side():
    with pytest.raises(ValueError, match="long side"):
        newton_schulz(torch.ones(40, 8), shape=(40, 16), reduce=lambda t: t)
    with pytest.raises(ValueError, match="long side"):
        newton_schulz(torch.ones(8, 40), shape=(16, 40), reduce=lambda t: t)
    with pytest.raises(ValueError, match="both"):
        newton_schulz(torch.ones(16, 20), shape=(16, 40))


@pytest.mark.parametrize("method", ["standard", "gram", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cost_model_counts_one_blocks_flops(method, dtype):
    block, shape = torch.randn(256, 320), (256, 2560)  # one of 8 blocks; auto: standard here, gram whole
    with FlopCounterMode(display=False) as counter:
        newton_schulz(block, dtype=dtype, method=method, shape=shape, reduce=lambda t: t)
    name = str(dtype).removeprefix("torch.")
    assert counter.get_total_flops() == ns_flops(*shape, 5, method, name, blocks=8)
    if method == "auto":
        assert ns_method_for(*shape, 5, "auto", name, 8) == "standard" and ns_method_for(*shape, 5, "auto", name) == "gram"


def test_one_block_is_the_whole_matrix():
    x = spectrum_matrix(16, 80, "ill", seed=8)
    for method in ("standard", "gram"):
        one = newton_schulz(x, dtype=torch.float64, method=method, shape=(16, 80), reduce=lambda t: t)
        assert float((one - newton_schulz(x, dtype=torch.float64, method=method)).abs().max()) < BLOCKS_FP64_ATOL


def test_muon_on_blocks_equals_muon_on_the_whole_matrix():
    config = MuonConfig(ns_dtype="float64", scale_mode="spectral", nesterov=True, ns_method="gram")
    grads = [torch.randn(48, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    whole_state = MuonState.create((48, 12), grad_dtype=torch.float64)
    blocks_state = [MuonState.create((24, 12), grad_dtype=torch.float64) for _ in range(2)]
    for grad in grads:
        whole = muon_update(grad, whole_state, config)
        blocks = grad.tensor_split(2)
        out, _ = on_threads(2, lambda r, reduce: muon_update(blocks[r], blocks_state[r], config, shape=(48, 12),
                                                            reduce=reduce))
        assert float((torch.cat(out) - whole).abs().max()) < BLOCKS_FP64_ATOL  # the scale of 48 x 12, not 24 x 12
    assert torch.equal(torch.cat([s.momentum for s in blocks_state]), whole_state.momentum)
