"""The Shampoo and SOAP flags, generated from their config dataclasses: one flag per field, the
dataclass's defaults, and every value reaching the config; ``--canzona-no-stagger-refresh``
(shared by both) reaches it too, staggering being the default."""

from __future__ import annotations

import argparse

import dataclasses

import pytest

from canzona_patches.integration.arguments import (
    CANZONA_FLAG_FIELDS,
    MATRIX_FLAGS,
    CanzonaArgumentError,
    add_canzona_args,
    canzona_config_from_args,
    validate_canzona_args,
)
from megatron.canzona.optim import ShampooConfig, SOAPConfig


def parse(*flags: str) -> argparse.Namespace:
    from megatron.training.arguments import add_megatron_arguments

    parser = add_canzona_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    return parser.parse_args(list(flags))


@pytest.mark.parametrize("optimizer", ["shampoo", "soap"])
def test_refreshes_are_staggered_unless_asked_not_to(optimizer):
    assert canzona_config_from_args(parse("--optimizer", optimizer)).matrix.stagger_refresh is True
    off = canzona_config_from_args(parse("--optimizer", optimizer, "--canzona-no-stagger-refresh"))
    assert off.matrix.stagger_refresh is False


def test_no_flags_give_the_dataclass_defaults():
    assert canzona_config_from_args(parse("--optimizer", "shampoo")).matrix == ShampooConfig()
    assert canzona_config_from_args(parse("--optimizer", "soap")).matrix == SOAPConfig()


@pytest.mark.parametrize(("optimizer", "flags", "expected"), [
    ("shampoo", ["--shampoo-beta1", "0.8", "--shampoo-beta2", "0.9", "--shampoo-epsilon", "1e-6",
                 "--shampoo-statistics", "sum", "--shampoo-root-dtype", "float64", "--shampoo-grafting", "none",
                 "--shampoo-inverse-root", "2", "--shampoo-precondition-frequency", "3"],
     dict(momentum=0.8, shampoo_beta=0.9, eps=1e-6, statistics="sum", root_dtype="float64", grafting="none",
          inverse_root=2, precondition_frequency=3)),
    ("soap", ["--soap-beta1", "0.8", "--soap-beta2", "0.9", "--soap-shampoo-beta", "0.97", "--soap-eps", "1e-7",
              "--no-soap-correct-bias", "--soap-refresh", "eigh", "--soap-power-iter-steps", "2",
              "--soap-max-precond-dim", "512"],
     dict(betas=(0.8, 0.9), shampoo_beta=0.97, eps=1e-7, correct_bias=False, refresh="eigh", power_iter_steps=2,
          max_precond_dim=512)),
])
def test_every_flag_reaches_its_field(optimizer, flags, expected):
    matrix = canzona_config_from_args(parse("--optimizer", optimizer, *flags)).matrix
    assert {name: getattr(matrix, name) for name in expected} == expected


@pytest.mark.parametrize("optimizer", ["shampoo", "soap"])
def test_every_field_but_the_shared_stagger_has_a_flag(optimizer):
    flags = MATRIX_FLAGS[optimizer]
    dests = set(vars(parse()))
    for field in dataclasses.fields(flags.src_cfg_class):
        if field.name == "stagger_refresh":
            continue
        names = flags.renames.get(field.name, field.name)
        for name in names if isinstance(names, tuple) else (names,):
            assert f"{optimizer}_{name}" in dests, field.name


def test_a_bad_choice_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        parse("--optimizer", "shampoo", "--shampoo-root-dtype", "float16")
    assert "invalid choice: 'float16'" in capsys.readouterr().err


def test_the_canzona_flags_default_to_the_config():
    from megatron.canzona.runtime.config import CanzonaConfig

    parsed, stock = canzona_config_from_args(parse("--optimizer", "muon")), CanzonaConfig()
    for name in CANZONA_FLAG_FIELDS:
        assert getattr(parsed, name) == getattr(stock, name), name


@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "soap"])
def test_a_config_without_matrix_settings_takes_its_optimizers_defaults(optimizer):
    from megatron.canzona.optim import MATRIX_OPTIMIZERS, MuonConfig
    from megatron.canzona.runtime.config import CanzonaConfig

    config_type = MATRIX_OPTIMIZERS[optimizer].config_type
    assert CanzonaConfig(optimizer=optimizer).matrix == config_type()
    if config_type is not MuonConfig:
        with pytest.raises(TypeError, match=f"needs a {config_type.__name__}, got MuonConfig"):
            CanzonaConfig(optimizer=optimizer, matrix=MuonConfig())


@pytest.mark.parametrize("method", ["standard", "gram", "auto"])
def test_muon_ns_method_reaches_the_config_and_the_cost_model(method):
    config = canzona_config_from_args(parse("--optimizer", "muon", "--canzona", "--muon-ns-method", method))
    assert config.matrix.ns_method == method
    cost = config.cost_model()
    assert (cost.ns_method, cost.ns_dtype, cost.ns_steps) == (method, config.matrix.ns_dtype, config.matrix.num_ns_steps)


@pytest.mark.parametrize("flags", [["--optimizer", "muon"], ["--optimizer", "shampoo", "--canzona"]])
def test_muon_ns_method_other_than_standard_needs_canzonas_muon(flags):
    args = parse(*flags, "--muon-ns-method", "gram", "--use-distributed-optimizer")
    with pytest.raises(CanzonaArgumentError, match="--muon-ns-method gram is Canzona's Muon"):
        validate_canzona_args(args)


@pytest.mark.quick
def test_adaptive_muon_takes_muons_flags_and_its_second_moments():
    from megatron.canzona.optim import AdaptiveMuonConfig

    config = canzona_config_from_args(parse(
        "--optimizer", "adaptive_muon", "--canzona", "--adaptive-muon-moment2-method", "normuon",
        "--adaptive-muon-beta2", "0.9", "--adaptive-muon-eps", "1e-6", "--muon-momentum", "0.9",
        "--muon-ns-method", "gram"))
    assert isinstance(config.matrix, AdaptiveMuonConfig) and config.optimizer == "adaptive_muon"
    assert (config.matrix.moment2_method, config.matrix.beta2, config.matrix.moment2_eps) == ("normuon", 0.9, 1e-6)
    assert (config.matrix.momentum, config.matrix.ns_method) == (0.9, "gram")
    assert config.cost_model().kind == "adaptive_muon"
    stock = canzona_config_from_args(parse("--optimizer", "adaptive_muon", "--canzona")).matrix
    assert (stock.moment2_method, stock.beta2, stock.moment2_eps) == ("adamuon", 0.95, 1e-8)  # Megatron's defaults


@pytest.mark.parametrize(("flags", "message"), [
    (["--optimizer", "muon", "--canzona", "--adaptive-muon-beta2", "0.9"],
     "--adaptive-muon-beta2 sets AdaMuon's and NorMuon's second moment: pass --optimizer adaptive_muon"),
    (["--optimizer", "adaptive_muon"], "stops at its first step"),
])
def test_adaptive_muon_flags_are_refused_where_they_do_nothing(flags, message):
    with pytest.raises(CanzonaArgumentError, match=message):
        validate_canzona_args(parse(*flags, "--use-distributed-optimizer"))


def test_a_moment2_method_outside_the_choices_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        parse("--optimizer", "adaptive_muon", "--adaptive-muon-moment2-method", "namo")
    assert "invalid choice: 'namo'" in capsys.readouterr().err
