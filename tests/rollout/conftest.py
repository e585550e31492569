"""Fixtures: the session's tiny Qwen3 model (tests/conftest.py) under the name these tests use."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model_dir):
    """Path of the session's random-init tiny Qwen3 model dir (tests/conftest.py)."""
    return tiny_model_dir
