"""``--canzona-no-stagger-refresh`` reaches the Shampoo and SOAP configs; staggering is the default."""

from __future__ import annotations

import argparse

import pytest

from canzona_patches.integration.arguments import add_canzona_args, canzona_config_from_args


def parse(*flags: str) -> argparse.Namespace:
    from megatron.training.arguments import add_megatron_arguments

    parser = add_canzona_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    return parser.parse_args(list(flags))


@pytest.mark.parametrize("optimizer", ["shampoo", "soap"])
def test_refreshes_are_staggered_unless_asked_not_to(optimizer):
    assert canzona_config_from_args(parse("--optimizer", optimizer)).matrix.stagger_refresh is True
    off = canzona_config_from_args(parse("--optimizer", optimizer, "--canzona-no-stagger-refresh"))
    assert off.matrix.stagger_refresh is False
