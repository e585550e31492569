"""Fixtures of the loss tests."""

import pytest

from stapo.losses import MASKS


@pytest.fixture
def clean_registry():
    """The mask registry as it was before the test (tests register their own masks)."""
    before = dict(MASKS)
    yield
    MASKS.clear()
    MASKS.update(before)
