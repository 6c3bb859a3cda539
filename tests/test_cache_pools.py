"""The KV page pool and the GDN state pool, alone and under the scheduler: no leak, no double free, ever."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import models

from deltaserve.cache.kv_pool import KVPool, PoolCorruption, PoolExhausted
from deltaserve.cache.state_pool import StatePool
from deltaserve.engine.admission import AdmissionPolicy
from deltaserve.engine.request import Request, RequestStream, SamplingParams
from deltaserve.engine.sampler import Sampled
from deltaserve.engine.scheduler import QueueFull, RequestRefused, Scheduler
from deltaserve.text.tokenizer import Tokenizer
from deltaserve.models.batch import ATTENTION, GDN, CacheGeometry

GEOMETRY = CacheGeometry(layer_kinds=(GDN, ATTENTION, GDN), num_kv_heads=2, head_dim=4, conv_dim=6, conv_width=4,
                         num_v_heads=2, key_head_dim=3, value_head_dim=5)
VOCAB = 32
EOS = 1


def test_pages_slots_and_refcounts():
    pool = KVPool(GEOMETRY, num_pages=6, page_size=4)
    assert pool.k[0] is None and pool.k[1].shape == (24, 2, 4) and pool.bytes == 2 * 24 * 2 * 4 * 4
    pool.ensure("a", 5)  # 5 tokens: two pages
    pool.ensure("a", 8)  # still two
    assert pool.pages("a") == [0, 1] and pool.slots("a").tolist() == list(range(8))
    pool.ensure("b", 1)
    pool.ensure("a", 9)
    assert pool.pages("a") == [0, 1, 3]
    assert pool.slots("a").tolist() == list(range(8)) + [12, 13, 14, 15]
    pool.share("c", pool.pages("a")[:2])  # a prefix held twice
    assert pool.refcount(0) == 2 and pool.free_pages == 2
    assert pool.free("a") == 1  # pages 0 and 1 are still held by c
    assert pool.free_pages == 3 and pool.refcount(0) == 1
    pool.check()
    with pytest.raises(PoolExhausted):
        pool.allocate("d", 4)  # all or nothing
    assert pool.free_pages == 3
    assert pool.free("c") == 2 and pool.free("b") == 1 and pool.free("b") == 0
    assert pool.free_pages == 6
    pool.check()


def test_double_free_and_sharing_a_free_page_raise():
    pool = KVPool(GEOMETRY, num_pages=3, page_size=2)
    pool.allocate("a", 2)
    pool._pages["ghost"] = [0]  # a table corrupted by a bug elsewhere: page 0 listed twice
    pool.free("a")
    with pytest.raises(PoolCorruption, match="freed twice"):
        pool.free("ghost")
    with pytest.raises(PoolCorruption, match="free"):
        pool.share("b", [2])


def test_state_slots_are_zeroed_when_taken():
    pool = StatePool(GEOMETRY, num_slots=2)
    assert pool.conv[1] is None and pool.recurrent[0].shape == (2, 2, 3, 5)
    a = pool.take("a")
    pool.conv[0][a].fill_(3.0)
    pool.recurrent[2][a].fill_(-1.0)
    b = pool.take("b")
    pool.copy(a, b)
    assert torch.equal(pool.conv[0][b], pool.conv[0][a])
    with pytest.raises(PoolExhausted):
        pool.take("c")
    with pytest.raises(PoolCorruption):
        pool.take("a")
    assert pool.release("a") and not pool.release("a")
    again = pool.take("c")
    assert again == a and pool.conv[0][again].abs().sum() == 0 and pool.recurrent[2][again].abs().sum() == 0
    pool.check()


# -- the scheduler over both pools, without a model --------------------------------------------------------------


def tokenizer() -> Tokenizer:
    return Tokenizer(Backend(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0")))


def scheduler(pool_pages: int, page_size: int, slots: int, queue: int = 4, chunk: int = 8) -> Scheduler:
    policy = AdmissionPolicy(kv_pool_tokens=pool_pages * page_size, page_size=page_size, state_slots=slots,
                             context_length=pool_pages * page_size, max_new_tokens_cap=40, default_max_tokens=None,
                             max_queue=queue)
    return Scheduler(KVPool(GEOMETRY, pool_pages, page_size), StatePool(GEOMETRY, slots), policy,
                     prefill_chunk_tokens=chunk)


def submit(s: Scheduler, tok: Tokenizer, name: str, prompt_len: int, max_tokens: int | None) -> Request:
    reservation = s.admit(prompt_len, max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    request = Request(name, [2 + i % (VOCAB - 2) for i in range(prompt_len)], params, reservation.max_new_tokens,
                      reservation.kv_pages, RequestStream(name), tok, frozenset({EOS}), torch.Generator(), 0.0,
                      reservation)
    s.add(request)
    return request


def step(s: Scheduler, tokens: list[int]) -> None:
    plan = s.schedule()
    if plan is None:
        return
    for request, n in plan.sequences:  # what the runner would write: inside the reservation, pages present
        assert s.kv_pool.capacity(request) >= request.num_cached + n
        assert s.kv_pool.capacity(request) <= request.reserved_pages * s.kv_pool.page_size
    # the rows the ledger prices: a chunk beside one decode row per slot; past the chunk only to end a prompt
    assert len(plan.decode) + sum(n for _, n in plan.prefill) <= s.prefill_chunk_tokens + s.policy.state_slots
    over = sum(n for _, n in plan.prefill) > s.prefill_chunk_tokens
    assert not over or all(r.num_cached + n == r.prompt_len for r, n in plan.prefill)
    s.complete(plan, [Sampled(tokens[i % len(tokens)]) for i in range(len(plan.sampling))])


operation = st.one_of(
    st.tuples(st.just("arrive"), st.integers(1, 60), st.one_of(st.none(), st.integers(1, 30))),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, max_size=60), st.integers(4, 24), st.sampled_from([1, 4, 16]), st.integers(1, 3))
def test_random_arrivals_aborts_and_finishes_never_leak(ops, pool_pages, page_size, slots):
    s = scheduler(pool_pages, page_size, slots)
    tok = tokenizer()
    requests: list[Request] = []
    for op in ops:
        if op[0] == "arrive":
            try:
                requests.append(submit(s, tok, f"r{len(requests)}", op[1], op[2]))
            except (RequestRefused, QueueFull):
                pass
        elif op[0] == "abort" and requests:
            s.abort(requests[op[1] % len(requests)])
        elif op[0] == "step":
            step(s, op[1])
        s.check()
        assert s.ledger.in_use_kv_pages <= s.policy.kv_pool_pages
        for r in requests:
            assert len(r.output_ids) <= r.max_new_tokens
    while s.has_work:  # everything left runs to its end
        step(s, [EOS + 1])
        s.check()
    assert s.kv_pool.free_pages == pool_pages and s.state_pool.free_slots == slots
    assert all(r.finished for r in requests)
    assert sum(s.finished_by_reason.values()) == len(requests)


def test_waiting_request_starts_when_its_whole_reservation_fits():
    s = scheduler(pool_pages=10, page_size=4, slots=4, chunk=32)
    tok = tokenizer()
    a = submit(s, tok, "a", 10, 10)  # 20 tokens: 5 pages
    b = submit(s, tok, "b", 10, 10)
    c = submit(s, tok, "c", 10, 10)
    step(s, [5])
    assert s.running == [a, b] and list(s.waiting) == [c]
    assert s.kv_pool.used_pages == 6  # lazily: 3 pages each so far, not the 5 reserved
    s.abort(a)
    step(s, [5])
    assert s.running == [b, c] and s.kv_pool.free_pages == 10 - 3 - 3
    with pytest.raises(RequestRefused, match="maximum context length is 40 tokens"):
        submit(s, tok, "huge", 30, 20)
    for name in "defg":
        submit(s, tok, name, 2, 2)
    with pytest.raises(QueueFull) as full:
        submit(s, tok, "h", 2, 2)
    assert full.value.retry_after_s >= 1


def test_a_prompt_ends_in_the_decode_rows_a_step_leaves_unused():
    """Chunk 8 beside 3 decode rows (one per slot) is what the ledger prices: a lone 11-token prompt is read in one
    step, a 12-token one in 8 + 4; beside a running decode one row fewer is spare; and never past the attention
    workspace the ledger prices (a chunk's scores over the longest context)."""
    def chunks(s, name, prompt_len, max_tokens=4):
        request = submit(s, tok, name, prompt_len, max_tokens)
        sizes = []
        while not request.prefilled:
            plan = s.schedule()
            sizes += [n for r, n in plan.prefill if r is request]
            s.complete(plan, [Sampled(5)] * len(plan.sampling))
        return request, sizes

    tok = tokenizer()
    s = scheduler(pool_pages=16, page_size=4, slots=3, chunk=8)
    assert chunks(s, "a", 11)[1] == [11]
    s.abort(s.running[0])
    assert chunks(s, "b", 12)[1] == [8, 4]
    # "b" decodes beside the next prompt: two spare rows
    assert chunks(s, "c", 10)[1] == [10]
    s.abort(s.running[-1])
    assert chunks(s, "d", 11)[1] == [8, 3]
    # 11 rows x 11 keys = 121 scores > 8 rows x a 12-token context: no fold
    s = scheduler(pool_pages=3, page_size=4, slots=3, chunk=8)
    assert chunks(s, "e", 11, max_tokens=1)[1] == [8, 3]
