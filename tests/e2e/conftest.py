"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest

from .support import DemoData, make_demo_data


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> DemoData:
    """Tokenizer and indexed dataset from one shipped book, shared by every test of the session."""
    return make_demo_data(tmp_path_factory.mktemp("demo"))
