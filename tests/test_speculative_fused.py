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
from deltaserve.models.decode_stack_path import DecodeStackPath, step_logits
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
    with a fresh decode_stack argument cache, so the path's `stack._args` says whether the one-call path ran."""
    other = copy.deepcopy(caches)
    DecodeStackPath.of(model).forget()
    fused = step_logits(model, batch, caches)
    with decode_cpu.disabled():
        plain = step_logits(model, batch, other)
    return fused, plain, caches, other


@pytest.mark.parametrize("kind,weights", [("llama", "fp32"), ("qwen3", "int4")])
@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
@torch.inference_mode()
def test_verify_rows_take_the_fused_path_and_equal_the_per_op_path(kind, weights, cache, isa):
    """Llama's head dim 32 attends row by row; Qwen3's 64 attends a request's rows together (paged_attention.h
    decode_all's runs, each query over its own length), on the native and the AVX2 build."""
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
    assert DecodeStackPath.of(model).stack._args is not None  # one decode_stack call served the step
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


def hybrid_model(tmp_path):
    import json

    from deltaserve.models import build_model, skip_prefixes
    from deltaserve.weights import load_checkpoint
    from test_models_hybrid import make_checkpoint

    ref = make_checkpoint("qwen3_5_text", tmp_path)
    ckpt = load_checkpoint(tmp_path, skip_prefixes=skip_prefixes(json.loads((tmp_path / "config.json").read_text())))
    return build_model(ckpt.config, ckpt.tensors), ref.config.num_hidden_layers


def with_snapshots(caches, slots: int):
    """The caches with snapshot tensors of `slots` states per GDN layer (the engine's are the checkpoint pool's)."""
    caches.snapshot_conv = [None if t is None else torch.zeros((slots, *t.shape[1:])) for t in caches.conv]
    caches.snapshot_recurrent = [None if t is None else torch.zeros((slots, *t.shape[1:])) for t in caches.recurrent]
    return caches


def gdn_states(caches, slot: int, snapshot: bool = False) -> list[torch.Tensor]:
    conv, rec = (caches.snapshot_conv, caches.snapshot_recurrent) if snapshot else (caches.conv, caches.recurrent)
    return [t[slot].clone() for t in conv + rec if t is not None]


@torch.inference_mode()
def test_hybrid_verify_rows_chain_the_gdn_state_and_keep_snapshots(tmp_path):
    """Qwen3.5's GDN layers: a verifying request's rows run in order on its state slot (row j from row j - 1's conv
    and recurrent state), the state after row j (j < 1 + k) goes to its snapshot slot, the state after all rows to
    its slot. Against the per-op path on the same step (logits, states, snapshots), and the snapshots and final
    states against plain one-row decode steps of the same tokens (what rollback must restore)."""
    from test_decode_fused import decode_batch
    from test_models_hybrid import VOCAB as HYBRID_VOCAB

    assert decode_cpu.load() is not None
    model, layers = hybrid_model(tmp_path)
    gen = torch.Generator().manual_seed(17)
    prompts = [torch.randint(0, HYBRID_VOCAB, (n,), generator=gen).tolist() for n in (6, 23, 11)]
    caches, last = prefilled(model, prompts, torch.float32)
    caches = with_snapshots(caches, 16)
    start = copy.deepcopy(caches)
    chunks = [[last[1], *torch.randint(0, HYBRID_VOCAB, (3,), generator=gen).tolist()],
              [last[2], *torch.randint(0, HYBRID_VOCAB, (2,), generator=gen).tolist()]]
    # as the scheduler asks: snapshots after rows 1..k of each verifying request (sequences 1 and 2)
    snapshots = ((1, 1, 4), (1, 2, 5), (1, 3, 6), (2, 1, 9), (2, 2, 10))
    lens = [len(p) for p in prompts]
    batch = verify_batch(lens, chunks, [last[0]], snapshots)
    fused, plain, caches, other = both_ways(model, batch, caches)
    assert DecodeStackPath.of(model).stack._args is not None  # one decode_stack call served the step
    tol = logits_rtol(layers, 64 * 16) * plain.abs().max().item()
    assert (fused - plain).abs().max().item() <= tol
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))

    def close(got, want):
        for a, b in zip(got, want):
            assert (a - b).abs().max().item() <= 1e-4 * (1 + b.abs().max().item())

    for slot in range(3):
        close(gdn_states(caches, slot), gdn_states(other, slot))
    for _, _, snap in snapshots:
        close(gdn_states(caches, snap, True), gdn_states(other, snap, True))
    # plain decode steps of each chunk's tokens, one row a step (the fused decode path, no speculation)
    for b, chunk, snaps in ((1, chunks[0], (4, 5, 6)), (2, chunks[1], (9, 10))):
        ref = copy.deepcopy(start)
        for j, token in enumerate(chunk):
            step = decode_batch([token], [lens[b] + j])
            step.context_slots += b * SLOTS_PER_SEQ
            step.slot_mapping += b * SLOTS_PER_SEQ
            step.state_slots[0] = b
            model(step, ref)
            want = gdn_states(ref, b)
            close(gdn_states(caches, snaps[j], True) if j < len(snaps) else gdn_states(caches, b), want)


def test_rows_of_one_state_slot_must_be_adjacent():
    """gdn_block runs a slot's rows as one run, in order; a slot in two runs would race between threads: refused."""
    from test_kernel_capability import float_projection, rand

    assert decode_cpu.load() is not None
    hidden, hk, hv, dk, dv, width = 64, 2, 4, 16, 32, 4
    c = 2 * hk * dk + hv * dv
    tensors = [rand(hidden, seed=1), rand(c, width, seed=2), rand(hv, seed=3), rand(hv, seed=4), rand(dv, seed=5)]
    for j, (n, k) in enumerate([(c, hidden), (hv * dv, hidden), (hv, hidden), (hv, hidden), (hidden, hv * dv)]):
        tensors += float_projection(n, k, seed=10 + j)
    conv, states = rand(4, c, width - 1, seed=7), rand(4, hv, dk, dv, seed=8)
    meta = [hk, hv, dk, dv, 0, 0, 0, 0, 0]
    decode_cpu.gdn_block(rand(3, hidden, seed=6), tensors, meta, conv, states, torch.tensor([1, 1, 0]), 1e-6, 1.0,
                         1e-6)
    with pytest.raises(RuntimeError, match="adjacent"):
        decode_cpu.gdn_block(rand(3, hidden, seed=6), tensors, meta, conv, states, torch.tensor([0, 1, 0]), 1e-6, 1.0,
                             1e-6)
