"""Fixtures of the loss tests."""

import pytest

from stapo.losses import masks as masks_module


@pytest.fixture
def clean_registry():
    """The mask registry as it was before the test (tests register their own masks)."""
    before = dict(masks_module._REGISTRY)
    yield
    masks_module._REGISTRY.clear()
    masks_module._REGISTRY.update(before)
