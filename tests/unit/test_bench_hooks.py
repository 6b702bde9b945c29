"""tools/bench_hooks.py times the bucket-group hooks through their real wrappers, the reduce
order's hold and release included."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.quick


def test_the_hooks_are_timed_with_a_group_held_and_released(capsys, import_tool):
    bench_hooks = import_tool("bench_hooks")
    assert bench_hooks.main(["--number", "2000"]) == 0  # it asserts that its held row held
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    assert [row.rsplit(maxsplit=1)[0].strip() for row in rows] == [
        "no listener (every run)", "reduce order on, a matrix bucket group", "reduce order on, held and released"]
