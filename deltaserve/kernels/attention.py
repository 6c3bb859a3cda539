"""Attention over the paged KV cache: write the new K/V rows, then attend to each sequence's whole context.

Decode rows on CPU read the pages in place (kernels/paged_cpu.py) and prefill chunks run kernels/prefill_cpu.py's
tiled kernel, once the engine has built them. The portable PyTorch path (gather + scaled_dot_product_attention)
serves everything else, one sequence at a time over exactly its context: decode rows with no mask, prefill chunks
causally (on CPU the cached prefix and the chunk's own rows apart, joined by their logsumexp; elsewhere with a
causal mask offset by what is cached).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deltaserve.kernels import paged_cpu, prefill_cpu


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new K/V rows [T, Hkv, D] at their flat slots (page * page_size + offset)."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch, scale: float) -> torch.Tensor:
    """Causal attention for a packed batch; returns [T, Hq, D].

    q: [T, Hq, D]; k, v: the new rows [T, Hkv, D] (already written to the caches). `batch` is a
    models.batch.ForwardBatch. Hq must be a multiple of Hkv (grouped-query attention).
    """
    write_kv(k_cache, v_cache, batch.slot_mapping, k, v)
    if k_cache.dtype != k.dtype:
        # a fresh prompt reads its own rows as the cache stores them, as every later chunk and decode step does: one
        # rounding at one point, so a 16-bit cache's answer does not depend on where the chunks fell
        k, v = k.to(k_cache.dtype).to(k.dtype), v.to(v_cache.dtype).to(v.dtype)
    out = torch.empty_like(q)
    cu = batch.cu_q.tolist()
    nd = batch.num_decode
    if nd:
        if batch.paged_kernel and _paged_cpu_inputs(q, k_cache) and paged_cpu.ready() is not None:
            out[:nd] = paged_cpu.paged_decode_attention(q[:nd], k_cache, v_cache, batch.context_slots[:nd],
                                                        batch.decode_context_lens, scale)
        else:
            out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, batch.context_slots[:nd],
                                         batch.context_lens[:nd], scale)
    for b in range(nd, batch.num_seqs):
        lo, hi = cu[b], cu[b + 1]
        cached = batch.cached_lens[b]
        if cached == 0:
            # A fresh prompt attends only to itself: use the new rows directly, no gather.
            out[lo:hi] = _prefill_attention(q[lo:hi], k[lo:hi], v[lo:hi], 0, scale, batch.paged_kernel)
        else:
            slots = batch.context_slots[b, : cached + hi - lo]
            out[lo:hi] = _prefill_attention(q[lo:hi], k_cache[slots].to(q.dtype), v_cache[slots].to(q.dtype),
                                            cached, scale, batch.paged_kernel)
    return out


def _paged_cpu_inputs(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (k_cache.device.type == "cpu" and q.dtype == torch.float32 and k_cache.is_contiguous()
            and paged_cpu.declines(q.shape[1], k_cache.shape[1], k_cache.dtype) is None)


# On CPU a prompt's own 384-767 rows are attended in query blocks of 128 rows, each over the keys up to its last row
# (~5/8 of the causal square). torch's CPU SDPA (flash kernel, torch 2.13) takes keys in blocks of min(rows, 512)
# and, below 768 rows, queries in blocks of 64, and skips only key blocks wholly above the diagonal: under 768 rows
# it computes nearly the whole square and masks half of it. Measured on Zen 4, 2 threads, 9 query and 3 KV heads
# of 64, alternated (ms a layer): 384 rows 3.4 -> 3.0, 512 rows 7.3 -> 5.6 (3.9 -> 3.0 on a quieter run), 640 rows
# 9.4 -> 8.2; at 256 rows and at 767 or more the blocks were slower (1.25 -> 1.41, 1024 rows 14.0 -> 17.6).
QUERY_BLOCK = 128
BLOCKED_ROWS = range(384, 768)

# torch's CPU flash kernel, which F.scaled_dot_product_attention runs on CPU, called directly for its logsumexp.
_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int, scale: float,
                       native: bool = False) -> torch.Tensor:
    """One sequence: q [S, Hq, D] at positions cached..cached+S-1 over k, v [cached+S, Hkv, D].

    `native`: the C++ kernel (kernels/prefill_cpu.py) where it is built and takes these inputs (float32 on CPU).
    Otherwise on CPU, rows after a cached prefix (a prefix-cache hit, a prompt's later chunks) attend in two parts: the
    cached keys whole (no mask) and their own rows causally, joined by each part's logsumexp. One masked call over
    everything computed the whole rectangle, half of the new rows' own square above the diagonal, and the mask
    (9 query and 3 KV heads of 64, Zen 4, ms a layer: 4 cached + 528 rows 4.7 -> 3.8, 200 + 512 6.2 -> 5.4,
    4096 + 512 40.8 -> 36.0)."""
    if native and prefill_cpu.serves(q, k):
        return prefill_cpu.prefill_attention(q, k, v, cached, scale)
    # 4-D inputs: with 3-D ones CPU SDPA takes the math path and materialises the whole score matrix.
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q.device.type == "cpu":
        o, lse = _causal_cpu(qh, kh[:, :, cached:], vh[:, :, cached:], scale)
        if cached:
            o_past, lse_past = _flash_cpu(qh, kh[:, :, :cached], vh[:, :, :cached], 0.0, False, scale=scale)
            # softmax over both parts = each part's softmax weighted by its share exp(lse_part) of the whole
            share_past = torch.sigmoid(lse_past - lse).unsqueeze(-1)
            o = torch.lerp(o.float(), o_past.float(), share_past).to(q.dtype)
    else:
        gqa = qh.shape[1] != kh.shape[1]
        mask = None
        if cached:
            total, s = k.shape[0], q.shape[0]
            mask = torch.arange(total, device=q.device) <= torch.arange(cached, cached + s, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=not cached, scale=scale,
                                           enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _causal_cpu(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of [1, H, S, D] rows over themselves on CPU: output and logsumexp [1, Hq, S]."""
    s = qh.shape[2]
    if s not in BLOCKED_ROWS:
        return _flash_cpu(qh, kh, vh, 0.0, True, scale=scale)
    o = qh.new_empty(qh.shape)
    lse = qh.new_empty(qh.shape[:3], dtype=torch.float32 if qh.dtype in (torch.bfloat16, torch.float16) else qh.dtype)
    square = _causal_mask(s, qh.dtype)
    for a in range(0, s, QUERY_BLOCK):
        b = min(a + QUERY_BLOCK, s)
        # the first block is causal as it stands (square); the others see keys 0..b-1 from row a
        mask = None if a == 0 else square[a:b, :b]
        o[:, :, a:b], lse[:, :, a:b] = _flash_cpu(qh[:, :, a:b], kh[:, :, :b], vh[:, :, :b], 0.0, a == 0,
                                                  attn_mask=mask, scale=scale)
    return o, lse


@functools.lru_cache(maxsize=4)
def _causal_mask(s: int, dtype: torch.dtype) -> torch.Tensor:
    """[s, s] additive causal mask (-inf above the diagonal), built once for every layer of a step (read only)."""
    return torch.full((s, s), float("-inf"), dtype=dtype).triu_(1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      context_slots: torch.Tensor, context_lens: list[int], scale: float) -> torch.Tensor:
    """B single-token queries q [B, Hq, D], each over its own context of context_lens[b] cached rows.

    One SDPA call per sequence over exactly its rows: padding a batch to its longest context and masking gathered
    and scored every padded row too (64 decodes of 200..1500 tokens: 3x slower on this CPU)."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[1]
    for b, length in enumerate(context_lens):
        slots = context_slots[b, :length]
        kh = k_cache[slots].to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, L, D]
        vh = v_cache[slots].to(q.dtype).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q[b, None, :, None], kh, vh, scale=scale, enable_gqa=gqa)
        out[b] = o[0, :, 0]
    return out
