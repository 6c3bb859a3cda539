"""The few-row CPU linear kernel against a float64 product, and when it serves."""

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels import linear_cpu

# every test here runs on each build of the C++ kernels: native and AVX2-only (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert linear_cpu.load() is not None  # this machine builds it; where none could, F.linear serves


def _reference(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


# Rows across the 6-row groups and their remainders; outputs across the 4-row weight blocks and a remainder;
# input widths of one vector, the models' hidden sizes and an MLP's intermediate size.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 13, 32, 64])
@pytest.mark.parametrize("out_features,in_features", [(1, 16), (3, 48), (193, 576), (1536, 576), (576, 1536)])
def test_matches_float64(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    assert linear_cpu.serves(x, w)
    got = linear_cpu.linear(x, w)
    ref = _reference(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert (got.double() - ref).abs().max() <= 2e-6 * ref.abs().max() + 1e-6


@pytest.mark.parametrize("out_features,in_features", [(3, 48), (193, 576), (1536, 576)])
def test_one_row_equals_its_row_of_a_batch(out_features, in_features):
    """A batch-1 step reads the weights row after row (one_row), a batch through the tile: every output is summed in
    the same order, so a row's result is bit for bit the same alone as among others (greedy tokens do not depend on
    the batch; tests/test_server_load.py caught a one-row order that differed)."""
    g = torch.Generator().manual_seed(out_features)
    x = torch.randn(9, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    for rows in (2, 3, 6, 9):
        together = linear_cpu.linear(x[:rows], w)
        for i in range(rows):
            assert torch.equal(linear_cpu.linear(x[i:i + 1], w)[0], together[i]), (rows, i)


def test_bias_and_leading_dims():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, generator=g)  # six rows
    w, b = torch.randn(10, 64, generator=g), torch.randn(10, generator=g)
    got = linear_cpu.linear(x, w, b)
    assert got.shape == (2, 3, 10)
    assert torch.allclose(got.double(), _reference(x, w, b), atol=1e-5)


def test_strided_input_is_read_as_its_values():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 8, generator=g).t()  # [8, 64], not contiguous
    w = torch.randn(20, 64, generator=g)
    assert torch.allclose(linear_cpu.linear(x, w).double(), _reference(x, w), atol=1e-5)


def test_what_it_does_not_take_goes_to_gemm():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(8, 48, generator=g)
    too_many = torch.randn(linear_cpu.MAX_ROWS + 1, 48, generator=g)
    odd_width = torch.randn(4, 40, generator=g)
    for x, weight in ((too_many, w), (odd_width, torch.randn(8, 40, generator=g)),
                      (torch.randn(4, 48, dtype=torch.float64, generator=g), w.double()),
                      (torch.randn(0, 48, generator=g), w)):
        assert not linear_cpu.serves(x, weight)
        assert _within_float32_sums(linear_cpu.linear(x, weight), x, weight)  # gemm's (oneDNN's or F.linear's)
    with linear_cpu.disabled():
        assert not linear_cpu.serves(torch.randn(4, 48), w)
    assert linear_cpu.serves(torch.randn(4, 48), w)


# -- gemm: a prefill chunk's many rows ---------------------------------------------------------------------------

def _within_float32_sums(got, x, w, b=None):
    """|got - exact| within the float32 summation bound K * 2^-24 * (|x| @ |w|.T + |b|), whatever the order."""
    exact = _reference(x, w, b)
    scale = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    return bool(((got.double() - exact).abs() <= x.shape[-1] * 2.0 ** -24 * scale + 1e-30).all())


def test_torch_here_ships_onednn_linear():
    """The pinned CPU torch has oneDNN's linear, so the prefill GEMMs below take it (not only F.linear's MKL)."""
    assert linear_cpu.ONEDNN


@pytest.mark.parametrize("rows", [17, 65, 512, 528])
@pytest.mark.parametrize("out_features,in_features", [(193, 576), (1536, 576), (576, 1536)])
def test_gemm_both_backends_match_float64(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    onednn = linear_cpu.gemm(x, w, b)
    with linear_cpu.mkl_gemm():
        mkl = linear_cpu.gemm(x, w, b)
    for got in (onednn, mkl):
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        assert _within_float32_sums(got, x, w, b)


def test_gemm_leading_dims_strided_input_and_what_it_passes_on():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 96, generator=g)
    x = torch.randn(3, 96, 70, generator=g).transpose(1, 2)  # [3, 70, 96], not contiguous
    got = linear_cpu.gemm(x, w)
    assert got.shape == (3, 70, 40) and _within_float32_sums(got, x, w)
    assert linear_cpu.linear(x, w).shape == (3, 70, 40)  # 210 rows: past the few-row kernel, to gemm
    for x, weight in ((torch.randn(0, 96), w), (x.double(), w.double()), (x.bfloat16(), w.bfloat16()),
                      (x, w.t().contiguous().t())):  # no rows, other dtypes, a strided weight: F.linear's
        assert torch.equal(linear_cpu.gemm(x, weight), F.linear(x, weight))
