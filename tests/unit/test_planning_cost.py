"""Cost model against hand-computed operation counts."""

import pytest

from megatron.canzona.planning import Calibration, CostModel, ParamSpec, muon_flops, shampoo_flops, soap_flops

pytestmark = pytest.mark.quick


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


def test_auto_takes_the_measured_method_where_a_calibration_timed_both(tmp_path):
    """``--muon-ns-method auto`` on a machine with Newton-Schulz timings: per shape measured,
    the faster method (either orientation of the shape); the FLOP rule for the others."""
    import json

    from megatron.canzona.planning.cost import CostModel, ns_method_for
    from megatron.canzona.planning.sim.cluster import measured_ns_methods

    def timings(seconds):
        return {"optimizer": "muon", "timings": [{"m": m, "n": n, "seconds": s} for (m, n), s in seconds.items()]}

    standard = {(4096, 12288): 8.3e-3, (4096, 4096): 3.7e-3, (24576, 4096): 16.0e-3}
    gram = {(4096, 12288): 7.6e-3, (4096, 4096): 4.8e-3}  # fc1 timed with standard only
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"optimizer": "muon", "ns_dtype": "bfloat16", "timings": [],
                                "muon_methods": {"standard": timings(standard), "gram": timings(gram)}}))
    measured = measured_ns_methods(str(path), "bfloat16")
    assert measured == ((4096, 4096, "standard"), (4096, 12288, "gram"))
    assert measured_ns_methods(str(path), "float32") == ()  # timed in another dtype: nothing taken
    # the FLOP rule keeps standard on 8B's fc2 (gram saves under 20% of its FLOPs); measured, gram
    assert ns_method_for(4096, 12288, 5, "auto", "bfloat16") == "standard"
    assert ns_method_for(12288, 4096, 5, "auto", "bfloat16", measured) == "gram"
    assert ns_method_for(24576, 4096, 5, "auto", "bfloat16", measured) == "gram"  # not measured: the rule
    assert ns_method_for(4096, 12288, 5, "standard", "bfloat16", measured) == "standard"  # only auto reads it
    model = CostModel(ns_method="auto", ns_measured=measured)
    assert model.flops(4096, 12288) == CostModel(ns_method="gram").flops(4096, 12288)


def test_the_shipped_h100_calibration_takes_gram_on_8b_and_14b_fc2():
    from pathlib import Path

    from megatron.canzona.planning.sim.cluster import measured_ns_methods

    shipped = Path(__file__).resolve().parents[2] / "tools" / "calibrations" / "h100-muon-bf16.json"
    chosen = {(a, b): m for a, b, m in measured_ns_methods(str(shipped), "bfloat16")}
    assert chosen[(4096, 12288)] == chosen[(5120, 17408)] == "gram"  # gram / standard 0.87-0.92 measured
    assert chosen[(2048, 6144)] == "standard"  # 1.7B's fc2: gram 2-3% slower there
    assert all(chosen[(a, b)] == "standard" for a, b in ((2048, 2048), (4096, 4096), (5120, 5120)))
