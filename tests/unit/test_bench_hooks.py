"""tools/bench_hooks.py times the bucket-group hooks through their real wrappers, the reduce
order's hold and release included."""

from __future__ import annotations

import pathlib
import sys

import pytest

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_hooks_are_timed_with_a_group_held_and_released(capsys):
    sys.path.insert(0, str(ROOT))
    try:
        from tools import bench_hooks
    finally:
        sys.path.remove(str(ROOT))
    assert bench_hooks.main(["--number", "2000"]) == 0  # it asserts that its held row held
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    assert [row.rsplit(maxsplit=1)[0].strip() for row in rows] == [
        "no listener (every run)", "reduce order on, a matrix bucket group", "reduce order on, held and released"]
