"""LOCAL_WORLD_SIZE: the node size the auto layout projects on, and a warning when a TP group spans nodes."""

from __future__ import annotations

import pytest

from canzona_patches.integration.layout import local_world_size, node_note

pytestmark = pytest.mark.quick


def test_local_world_size_reads_the_launchers_variable(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_world_size() == 8
    for bad in ("", "0", "eight"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        assert local_world_size() is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_world_size() is None


def test_a_tp_group_across_nodes_is_named(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert node_note(8) is None and node_note(4) is None and node_note(1) is None
    note = node_note(16)
    assert note is not None and "--tensor-model-parallel-size 16" in note and "\n" not in note
    assert "--expert-tensor-parallel-size 3" in node_note(2, ep_size=2, expert_tp_size=3)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert node_note(16) is None  # unknown node size: nothing to say
