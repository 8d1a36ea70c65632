"""Shared fixtures."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gpu_place():
    """mg.GPUPlace(0), or skip the test with the reason no GPU can be used here."""
    import minigraph as mg

    try:
        return mg.GPUPlace(0)
    except mg.GPUError as e:
        pytest.skip(str(e))
