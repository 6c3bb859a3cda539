"""Fixtures shared by the model tests."""

import pytest

from deltaserve.kernels import fused_cpu, int4_cpu, linear_cpu


@pytest.fixture(params=["fused", "portable"])
def cpu_kernels(request):
    """Each CPU path in turn: the C++ kernels the engine builds at start (fused ops, few-row linears, packed 4-bit
    matmul), and the portable PyTorch ops."""
    assert fused_cpu.load() is not None  # this machine builds them; where none could, the engine keeps portable
    assert linear_cpu.load() is not None
    assert int4_cpu.load() is not None
    if request.param == "portable":
        with fused_cpu.disabled(), linear_cpu.disabled(), int4_cpu.disabled():
            yield request.param
    else:
        yield request.param
