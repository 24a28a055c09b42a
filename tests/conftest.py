"""Session set-up shared by the test modules."""

from __future__ import annotations

import os

import pytest

from tests.world_traces import ENV


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """When the Hugging Face sharded worlds will run, the fork server their ranks come from traces
    their models first (tests/world_traces.py): it starts after collection, with this environment."""
    if any(item.path.name == "test_hf_sharded.py" for item in items):
        os.environ[ENV] = "1"
