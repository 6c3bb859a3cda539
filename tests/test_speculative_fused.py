"""A verifying step (engine/speculative.py: a request fed [last, d1..dk] as a chunk of 1 + k rows) on the native decode
path: models/batch.py's as_decode_rows makes each chunk row a decode row (position L + j over context L + j + 1), so
the step runs as one decode_stack call (kernels/decode_cpu.py) instead of layer by layer op by op. Its logits, the
K/V rows it writes and (hybrid models) the GDN states it leaves, the final one and the per-draft snapshots, equal the
per-op path's on the same batch to float32 rounding (tests/tolerance.py's bound).
"""

from __future__ import annotations

import copy

import pytest
import torch

from deltaserve.kernels import decode_cpu
from deltaserve.models.batch import ForwardBatch, as_decode_rows
from test_decode_fused import SLOTS_PER_SEQ, VOCAB, prefilled, tiny_dense
from tolerance import logits_rtol


def verify_batch(lens: list[int], chunks: list[list[int]], decode_tokens: list[int],
                 snapshots: tuple = ()) -> ForwardBatch:
    """Decode rows first (sequences 0 .. d - 1, one token each), then one chunk per following sequence, every row of
    it a logits row (as the runner builds a step with verifying requests); sequence b's context lives in slots
    b * SLOTS_PER_SEQ onwards."""
    feeds = [[t] for t in decode_tokens] + chunks
    ids, positions, new_slots, contexts, rows, q_lens = [], [], [], [], [], []
    for b, (n, feed) in enumerate(zip(lens, feeds)):
        base = b * SLOTS_PER_SEQ
        rows += range(len(ids), len(ids) + len(feed)) if b >= len(decode_tokens) else [len(ids)]
        ids += feed
        positions += range(n, n + len(feed))
        new_slots += range(base + n, base + n + len(feed))
        contexts.append(torch.arange(base, base + n + len(feed)))
        q_lens.append(len(feed))
    cu_q = torch.zeros(len(feeds) + 1, dtype=torch.long)
    torch.cumsum(torch.tensor(q_lens), 0, out=cu_q[1:])
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(positions), q_lens=q_lens, cached_lens=list(lens),
        num_decode=len(decode_tokens), cu_q=cu_q, slot_mapping=torch.tensor(new_slots),
        context_slots=torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True),
        state_slots=torch.arange(len(feeds)), logits_indices=torch.tensor(rows), snapshots=snapshots)


def both_ways(model, batch: ForwardBatch, caches):
    """(fused logits, per-op logits, fused caches, per-op caches) of one step from the same caches; the fused side
    with a fresh decode_stack argument cache, so `model.model.stack._args` says whether the one-call path ran."""
    other = copy.deepcopy(caches)
    model.model.stack = decode_cpu.Stack()
    fused = model(batch, caches)
    with decode_cpu.disabled():
        plain = model(batch, other)
    return fused, plain, caches, other


@pytest.mark.parametrize("kind,weights", [("llama", "fp32"), ("qwen3", "int4")])
@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
@torch.inference_mode()
def test_verify_rows_take_the_fused_path_and_equal_the_per_op_path(kind, weights, cache):
    assert decode_cpu.load() is not None
    model = tiny_dense(kind, weights)
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 30, 12, 1)]
    caches, last = prefilled(model, prompts, getattr(torch, cache))
    # one decode row, then verifying requests of 4, 2 and 9 rows (the last: k = 8, the most a step verifies)
    chunks = [[last[1], *torch.randint(0, VOCAB, (3,), generator=gen).tolist()], [last[2], 5],
              [last[3], *torch.randint(0, VOCAB, (8,), generator=gen).tolist()]]
    batch = verify_batch([len(p) for p in prompts], chunks, [last[0]])
    fused, plain, caches, other = both_ways(model, batch, caches)
    assert model.model.stack._args is not None  # one decode_stack call served the step
    assert fused.shape == plain.shape == (1 + 4 + 2 + 9, VOCAB)
    tol = logits_rtol(3, 192) * plain.abs().max().item()
    assert (fused - plain).abs().max().item() <= tol
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    step = 1e-6 if cache == "float32" else 2 ** -7
    for i in model.geometry.attention_layers:  # every row's K/V, the drafts' included
        for a, b in ((caches.k[i], other.k[i]), (caches.v[i], other.v[i])):
            assert ((a.float() - b.float()).abs() <= step * (1 + b.float().abs()) * 4).all()


@torch.inference_mode()
def test_chunks_it_does_not_take_keep_the_per_op_path():
    """A prompt's chunk longer than a verification, or more rows than the blocks take: not decode rows."""
    batch = verify_batch([5, 5], [[1] * 10], [1])
    assert as_decode_rows(batch, decode_cpu.MAX_ROWS) is None
    batch = verify_batch([5] * 8, [[1] * 9] * 7, [1])  # 1 + 63 rows: taken; one row more is not
    assert as_decode_rows(batch, decode_cpu.MAX_ROWS) is not None
    assert as_decode_rows(verify_batch([5] * 9, [[1] * 9] * 7, [1, 1]), decode_cpu.MAX_ROWS) is None
