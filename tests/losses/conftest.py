"""Fixtures of the loss tests."""

import pytest

from stapo.losses import MASKS


@pytest.fixture
def clean_registry():
    """The built-in masks only during the test (masks another test file registered, e.g. from examples/, are
    set aside: error messages list the registry), and the registry as it was after it."""
    before = dict(MASKS)
    for name in [name for name, cls in before.items() if not cls.__module__.startswith("stapo.")]:
        del MASKS[name]
    yield
    MASKS.clear()
    MASKS.update(before)
