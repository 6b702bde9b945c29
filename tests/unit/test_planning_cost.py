"""Cost model against hand-computed operation counts."""

import pytest

from megatron.canzona.planning import Calibration, CostModel, ParamSpec, muon_flops, shampoo_flops, soap_flops


def test_muon_flops_by_hand():
    # a=2, b=3: per step 4·a²·b + 2·a³ = 48 + 16 = 64.
    assert muon_flops(2, 3, ns_steps=1) == 64
    assert muon_flops(3, 2, ns_steps=5) == 320  # orientation does not matter


def test_shampoo_flops_by_hand():
    # left (d=4, other=6): 4·16·6 = 384 + 9/10·64 = 57.6; right (d=6, other=4): 4·36·4 = 576 + 0.9·216 = 194.4
    assert shampoo_flops(4, 6, precond_every=10) == pytest.approx(384 + 57.6 + 576 + 194.4)
    # a side over max_precond_dim is diagonal: 2·d·other = 48 for the right side
    assert shampoo_flops(4, 6, precond_every=10, max_precond_dim=5) == pytest.approx(384 + 57.6 + 48)


def test_soap_flops_by_hand():
    # left: 6·16·6 = 576 + (10/3)/10·64; right: 6·36·4 = 864 + (10/3)/10·216
    assert soap_flops(4, 6, precond_every=10) == pytest.approx(576 + 64 / 3 + 864 + 72)


def test_numel_and_split_blocks():
    fused = ParamSpec(name="qkv", global_shape=(12, 4), blocks=((8, 4), (2, 4), (2, 4)))
    whole = ParamSpec(name="qkv", global_shape=(12, 4))
    cm = CostModel(kind="muon", ns_steps=1)
    assert cm.cost(whole) == muon_flops(12, 4, 1)
    assert cm.cost(fused) == muon_flops(8, 4, 1) + 2 * muon_flops(2, 4, 1)
    assert CostModel(kind="numel").cost(whole) == 48


def test_calibration_replaces_formula_and_scales_the_rest():
    cal = Calibration(optimizer="muon", seconds={(4, 4): 2.0, (8, 4): 3.0})
    cm = CostModel(kind="muon", calibration=cal)
    assert cm.matrix_cost(4, 4) == 2.0
    ratios = sorted([2.0 / muon_flops(4, 4), 3.0 / muon_flops(8, 4)])
    assert cm.matrix_cost(16, 16) == pytest.approx(muon_flops(16, 16) * sum(ratios) / 2)
    assert Calibration.from_json(cal.to_json()) == cal
    assert cm.unit == "s"


def test_calibration_of_another_optimizer_is_rejected():
    with pytest.raises(ValueError, match="same optimizer"):
        CostModel(kind="soap", calibration=Calibration(optimizer="muon", seconds={(2, 2): 1.0}))


def test_unknown_cost_kind_names_the_choices():
    with pytest.raises(ValueError, match="muon"):
        CostModel(kind="adam")
