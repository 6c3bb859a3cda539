"""torch's int4 kernel fed from the packed layout (kernels/int4_torch.py): what a 4-bit matrix becomes on CUDA in a
bfloat16 model. The arithmetic is checked on every device torch has the kernel for here (the CPU always, CUDA where
present: bench/cuda_check.py runs this file on a lent GPU) against a float64 product of the dequantized weight, and
the loader's choice against the ledger's price of it.

The bound is derived, per term of the sum: the kernel rounds the input x, the scale and the zero to bfloat16 (unit
roundoff u = 2^-8 each) and may round the widened weight (q - 8) * s + z to bfloat16 once more; so a term
x * w is off by at most c = (1 + u)^4 - 1 of |x| (|q - 8| |s| + |z|), the float32 sum adds gamma_K (K u32) of the
terms' magnitudes, and the bfloat16 result one u of |y|."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import int4_torch
from deltaserve.kernels.int4 import Int4Codes, pack

U16 = 2.0 ** -8  # bfloat16's unit roundoff
U32 = 2.0 ** -24
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def weight(n: int, k: int, group: int, *, symmetric: bool, scale_dtype: torch.dtype, permuted: bool,
           seed: int = 0) -> Int4Codes:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    # asymmetric as GPTQ / compressed-tensors store it: an integer zero point 0..15, offset = -zp * scale
    offsets = None if symmetric else -torch.randint(0, 16, scales.shape, generator=gen) * scales.float()
    perm = torch.randperm(k, generator=gen) if permuted else None
    return Int4Codes(codes, scales, offsets, group, perm=perm)


def bound(x: torch.Tensor, w: Int4Codes) -> torch.Tensor:
    """The derived bound (module docstring) on |y - x @ W.T| per output, for W as the kernel forms it."""
    n, k = w.shape
    s = w.scales.double().repeat_interleave(w.group_size, 1)
    z = (w.offset_values().double() + 8 * w.scales.double()).repeat_interleave(w.group_size, 1)
    magnitude = (w.codes.double() - 8).abs() * s.abs() + z.abs()  # >= |w| term by term, stored column order
    if w.perm is not None:
        magnitude = torch.empty_like(magnitude).index_copy_(1, w.perm, magnitude)
    terms = x.double().abs() @ magnitude.t()
    c = (1 + U16) ** 4 - 1
    gamma = k * U32 / (1 - k * U32)
    y = x.double() @ w.dequantize(torch.float64).t()
    return (c + gamma) * (1 + c) * terms + U16 * (y.abs() + (c + gamma) * (1 + c) * terms)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("form", ["symmetric-bf16", "symmetric-fp16", "symmetric-f32", "asymmetric-f32",
                                  "asymmetric-permuted"])
def test_matches_float64_within_the_derived_bound(device, group, form):
    symmetric = form.startswith("symmetric")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(form.rpartition("-")[2], torch.float32)
    n, k = 80, 768
    w = weight(n, k, group, symmetric=symmetric, scale_dtype=dtype, permuted=form.endswith("permuted"))
    layer = int4_torch.convert(pack(w), device)
    assert layer.scales_and_zeros.dim() == (2 if symmetric else 3)  # a symmetric weight holds its scale alone
    assert layer.nbytes() == int4_torch.held_bytes(n, k, group, symmetric)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 5, 64):
        x = torch.randn(rows, k, generator=gen)
        y = int4_torch.int4_linear(x.to(device), layer).cpu()
        want = x.double() @ w.dequantize(torch.float64).t()
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        excess = ((y.double() - want).abs() - bound(x, w)).max().item()
        assert excess <= 0, (rows, excess)


@pytest.mark.parametrize("device", DEVICES)
def test_the_bound_catches_a_wrong_layout(device):
    """The check above can fail: the codes' nibbles swapped within each byte (even and odd columns exchanged) and a
    zero of the wrong sign both break the bound."""
    n, k, group = 64, 512, 64
    w = weight(n, k, group, symmetric=False, scale_dtype=torch.float32, permuted=False, seed=3)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(4))
    swapped = Int4Codes(w.codes.view(n, k // 2, 2).flip(-1).reshape(n, k), w.scales, w.offsets, group)
    flipped = Int4Codes(w.codes, w.scales, -16 * w.scales.float() - w.offsets, group)  # zero -> -zero
    for wrong in (swapped, flipped):
        y = int4_torch.int4_linear(x.to(device), int4_torch.convert(pack(wrong), device)).cpu()
        want = x.double() @ w.dequantize(torch.float64).t()
        assert ((y.double() - want).abs() - bound(x, w)).max().item() > 0


def test_bias_rows_and_dtypes():
    """A bias is added in float32; zero rows give [0, N]; the result comes back in the input's dtype; a leading batch
    shape is kept."""
    n, k, group = 16, 256, 128
    w = weight(n, k, group, symmetric=True, scale_dtype=torch.bfloat16, permuted=False)
    layer = int4_torch.convert(pack(w), "cpu")
    bias = torch.randn(n)
    x = torch.randn(2, 3, k)
    with_bias = int4_torch.int4_linear(x, layer, bias)
    assert with_bias.shape == (2, 3, n)
    assert torch.allclose(with_bias, int4_torch.int4_linear(x, layer) + bias, atol=4 * U16 * with_bias.abs().max())
    assert int4_torch.int4_linear(x.bfloat16(), layer).dtype == torch.bfloat16
    assert int4_torch.int4_linear(torch.empty(0, k), layer).shape == (0, n)


def test_what_it_takes():
    """Affine weights in groups of 32-256 with N a multiple of 16; level tables, per-channel groups and other N keep
    the packed layout; only CUDA in bfloat16 asks for it (config.torch_int4_layout)."""
    assert int4_torch.takes((16, 64), 32) and int4_torch.takes((4096, 5120), 128)
    assert not int4_torch.takes((16, 64), 32, lut=True)
    assert not int4_torch.takes((24, 64), 32)
    assert not int4_torch.takes((16, 1024), 1024)  # per channel
    assert int4_torch.serves("cuda", torch.bfloat16) and int4_torch.serves("cuda:1", "bfloat16")
    assert not int4_torch.serves("cuda", torch.float32) and not int4_torch.serves("cpu", torch.bfloat16)
    assert [int4_torch.inner_k_tiles(k) for k in (128, 192, 96)] == [8, 4, 2]
    w = weight(16, 64, 32, symmetric=True, scale_dtype=torch.float32, permuted=False)
    lut = Int4Codes(w.codes, w.scales, None, 32, lut=torch.linspace(-1, 1, 16))
    with pytest.raises(ValueError, match="level table"):
        int4_torch.convert(pack(lut), "cpu")
