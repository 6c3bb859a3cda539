"""Fixtures shared by the model tests."""

import pytest

from deltaserve.kernels import fused_cpu


@pytest.fixture(params=["fused", "portable"])
def cpu_kernels(request):
    """Each CPU path in turn: the fused C++ kernels the engine builds at start, and the portable PyTorch ops."""
    assert fused_cpu.load() is not None  # this machine builds it; where none could, the engine keeps portable
    if request.param == "portable":
        with fused_cpu.disabled():
            yield request.param
    else:
        yield request.param
