"""Fixtures shared by the tests: the CPU kernel paths (native C++ build, AVX2 build, portable PyTorch) and the
hypothesis profile."""

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, settings

from deltaserve.kernels import decode_cpu, fused_cpu, int4_cpu, linear_cpu, paged_cpu, prefill_cpu
from deltaserve.kernels.cpp_build import cpu_features

# Property tests are derandomized: a newcomer's `make test` runs the same examples every time, so it never fails at
# random; what a property finds is fixed, not skipped. HYPOTHESIS_PROFILE=explore searches afresh.
settings.register_profile("ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

KERNEL_MODULES = (fused_cpu, linear_cpu, paged_cpu, prefill_cpu, int4_cpu, decode_cpu)


@pytest.fixture(params=["fused", "portable"])
def cpu_kernels(request):
    """Each CPU path in turn: the C++ kernels the engine builds at start (fused ops, few-row linears, packed 4-bit
    matmul, fused decode blocks), and the portable PyTorch ops."""
    assert fused_cpu.load() is not None  # this machine builds them; where none could, the engine keeps portable
    assert linear_cpu.load() is not None
    assert int4_cpu.load() is not None
    assert decode_cpu.load() is not None
    if request.param == "portable":
        with fused_cpu.disabled(), linear_cpu.disabled(), int4_cpu.disabled(), decode_cpu.disabled():
            yield request.param
    else:
        yield request.param


def _has_avx2() -> bool:
    flags = cpu_features().split()
    return "avx2" in flags and "fma" in flags


@pytest.fixture(scope="session")
def avx2_kernels():
    """The CPU kernels built for AVX2 + FMA without AVX-512 (x86-64-v3), two compiles at a time."""
    if not _has_avx2():
        pytest.skip("this CPU has no AVX2: the AVX2 build cannot run here")
    variants = [m.KERNELS.variant("avx2") for m in KERNEL_MODULES]
    with ThreadPoolExecutor(2) as pool:
        modules = list(pool.map(lambda v: v.load(print), variants))
    assert all(modules), [v.error for v in variants]
    return modules


@pytest.fixture(params=["native", "avx2"])
def isa(request):
    """Each build of the C++ kernels in turn: -march=native (AVX-512 where the CPU has it) and AVX2 only, so the
    kernels' vector-width branches are both checked on one machine."""
    for m in KERNEL_MODULES:
        assert m.load() is not None
    if request.param == "native":
        yield request.param
        return
    modules = request.getfixturevalue("avx2_kernels")
    with contextlib.ExitStack() as stack:
        for m, module in zip(KERNEL_MODULES, modules):
            stack.enter_context(m.KERNELS.using(module))
        yield request.param
