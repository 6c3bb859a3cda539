"""The portable prefill attention (kernels/attention.py) against a float64 causal softmax, across the row counts
where a chunk's own rows are attended in query blocks and where they are not, with and without a cached prefix
(on CPU attended apart and joined by logsumexp)."""

import pytest
import torch

from deltaserve.kernels import attention


def _reference(q, k, v, cached, scale):
    """Row i (position cached + i) attends keys 0..cached + i, in float64."""
    qd, kd, vd = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    scores = torch.einsum("shd,thd->hst", qd, kd) * scale
    allowed = torch.arange(k.shape[0]) <= torch.arange(cached, cached + q.shape[0])[:, None]
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hst,thd->shd", weights, vd)


@pytest.mark.parametrize("rows,cached", [(1, 0), (200, 0), (383, 0), (384, 0), (385, 0), (528, 0), (767, 0),
                                         (768, 0), (500, 37), (16, 528), (1, 5), (640, 1),
                                         (384, 700), (100, 3000)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_prefill_attention_matches_float64(rows, cached, heads, kv_heads):
    assert (rows in attention.BLOCKED_ROWS) == (384 <= rows < 768)  # the cases above straddle both ends
    g = torch.Generator().manual_seed(rows * 10 + heads)
    q = torch.randn(rows, heads, 16, generator=g)
    k = torch.randn(cached + rows, kv_heads, 16, generator=g)
    v = torch.randn(cached + rows, kv_heads, 16, generator=g)
    got = attention._prefill_attention(q, k, v, cached, 0.25)
    assert got.shape == q.shape and got.dtype == torch.float32
    # a softmax-weighted mean of values of magnitude ~1: float32 rounding of the scores and the sum, a few 1e-7
    assert (got.double() - _reference(q, k, v, cached, 0.25)).abs().max() < 1e-5


@pytest.mark.parametrize("dtype,unit", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
@pytest.mark.parametrize("rows,cached", [(528, 0), (500, 37), (64, 300)])
def test_prefill_attention_16bit(dtype, unit, rows, cached):
    """16-bit inputs: the flash kernel accumulates in float32 and rounds each part's output once; the join rounds
    once more. Each rounding is within `unit` of the output, a mean of values of magnitude at most max |v|."""
    g = torch.Generator().manual_seed(rows + cached)
    q = torch.randn(rows, 6, 16, generator=g).to(dtype)
    k = torch.randn(cached + rows, 2, 16, generator=g).to(dtype)
    v = torch.randn(cached + rows, 2, 16, generator=g).to(dtype)
    got = attention._prefill_attention(q, k, v, cached, 0.25)
    assert got.dtype == dtype
    bound = 3 * unit * v.double().abs().max() + 1e-5
    assert (got.double() - _reference(q, k, v, cached, 0.25)).abs().max() < bound
