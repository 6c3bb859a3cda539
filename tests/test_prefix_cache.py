"""The prefix cache: greedy outputs with it equal those without it, on the dense built-in model and the tiny hybrid,
over random multi-turn conversations, branches and evictions; pool invariants with sharing; nothing leaked after a
flush. The oracle is the same engine with --no-prefix-cache (itself held to transformers by test_engine_*.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaserve.cache.prefix import EVICTION_POLICIES
from deltaserve.engine.engine import _widened
from deltaserve.budget import default_model_path
from deltaserve.engine.request import SamplingParams
from deltaserve.weights.gguf import read_gguf_tokenizer
from test_engine_support import HYBRID_VOCAB, engine, make_hybrid_checkpoint, random_prompt, tokens_of
from tolerance import logits_rtol

PAGE = 16
SMALL = dict(page_size=PAGE, prefill_chunk_tokens=48, max_running_requests=4)


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrid")
    make_hybrid_checkpoint(folder)
    return str(folder)


@pytest.fixture(scope="module")
def hybrid_pair(hybrid_folder):
    # A pool of 40 pages and 3 checkpoints: conversations below outgrow both, so pages and checkpoints are evicted.
    cached = engine(hybrid_folder, prefix_cache=True, max_total_tokens=640, checkpoint_slots=3,
                    checkpoint_interval_tokens=64, **SMALL)
    plain = engine(hybrid_folder, prefix_cache=False, max_total_tokens=640, **SMALL)
    return cached, plain


@pytest.fixture(scope="module")
def dense_pair():
    cached = engine(None, prefix_cache=True, max_total_tokens=640, **SMALL)
    plain = engine(None, prefix_cache=False, max_total_tokens=640, **SMALL)
    return cached, plain


def conversation(data, vocab: int, turns: int) -> list[tuple[list[int], int]]:
    """Prompts as an agent sends them: each turn resends a previous prompt (the last one, or an earlier one cut at
    a random point: a branch) and adds new tokens; with each, how many tokens to generate."""
    prompts: list[list[int]] = []
    plan = []
    for turn in range(turns):
        base: list[int] = []
        if prompts:
            source = data.draw(st.sampled_from(prompts), label="resent prompt")
            cut = data.draw(st.integers(1, len(source)), label="resent length")
            base = source[:cut]
        new = data.draw(st.integers(1, 70), label="new tokens")
        prompt = base + random_prompt(new, data.draw(st.integers(0, 10_000), label="seed"), vocab)
        prompt = prompt[-300:]  # within the pool beside the generation
        prompts.append(prompt)
        plan.append((prompt, data.draw(st.integers(1, 6), label="max_tokens")))
    return plan


def greedy(eng, prompt: list[int], max_tokens: int, boundaries=()) -> tuple[list[int], int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    stream = eng.submit(prompt, params, boundaries=boundaries)
    out = []
    while not stream.finished:
        eng.step()
        out += stream.drain()
    out += stream.drain()
    return tokens_of(out), out[-1].cached_tokens


def check_equal_over(pair, data, vocab: int, turns: int) -> None:
    cached, plain = pair
    if cached.prefix_cache.checkpoints is not None:
        cached.prefix_cache.eviction = data.draw(st.sampled_from(EVICTION_POLICIES), label="eviction")
    for prompt, max_tokens in conversation(data, vocab, turns):
        cut = data.draw(st.lists(st.integers(1, len(prompt)), max_size=3), label="message boundaries")
        got, hit = greedy(cached, prompt, max_tokens, tuple(cut))
        want, no_hit = greedy(plain, prompt, max_tokens)
        assert got == want, f"cached output differs after a hit of {hit} of {len(prompt)} prompt tokens"
        assert no_hit == 0 and hit < len(prompt)
        cached.scheduler.check()
    assert cached.stats().kv_pages_used == 0  # pages only the cache holds count as free


def assert_flush_leaves_nothing(eng) -> None:
    eng.flush_cache()
    eng.scheduler.check()
    assert eng.kv_pool.used_pages == 0 and eng.prefix_cache.cached_pages == 0
    if eng.checkpoint_pool is not None:
        assert eng.checkpoint_pool.used_slots == 0


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hybrid_cached_equals_uncached(hybrid_pair, data):
    check_equal_over(hybrid_pair, data, HYBRID_VOCAB, turns=5)


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_dense_cached_equals_uncached(dense_pair, data):
    check_equal_over(dense_pair, data, 2000, turns=4)


@pytest.mark.parametrize("model", ["hybrid", "dense"])
def test_hits_at_every_depth_and_nothing_leaks(hybrid_pair, dense_pair, model):
    """A prompt resent with a few more tokens each time hits exactly as deep as the previous prompt (the hybrid
    through its prompt-end checkpoints), at every offset within a page, and the outputs stay equal; after a flush
    no page or checkpoint is held."""
    cached, plain = hybrid_pair if model == "hybrid" else dense_pair
    cached.flush_cache()
    vocab = HYBRID_VOCAB if model == "hybrid" else 2000
    lengths = [17 * k for k in range(1, 16)] + [16 * 16, 17 * 16]
    tokens = random_prompt(lengths[-1], 7, vocab)
    previous = 0
    for length in lengths:
        got, hit = greedy(cached, tokens[:length], 1)  # one token: the generation stores nothing past the prompt
        assert hit == previous, (length, hit)
        assert got == greedy(plain, tokens[:length], 1)[0]
        previous = length
    assert {n % PAGE for n in lengths[:-1]} == set(range(PAGE))  # hits end at every offset within a page
    assert_flush_leaves_nothing(cached)


def test_checkpoints_at_message_boundaries_and_branch_points(hybrid_folder, hybrid_pair):
    """The hybrid keeps its state where the server says chat messages end, and where a prompt branches off a
    cached one: a later prompt that shares the prompt up to there hits there, to the token."""
    plain = hybrid_pair[1]
    cached = engine(hybrid_folder, prefix_cache=True, max_total_tokens=640, checkpoint_slots=8,
                    checkpoint_interval_tokens=64, **SMALL)
    base = random_prompt(90, 21, HYBRID_VOCAB)
    greedy(cached, base, 1, boundaries=(37, 61))
    for shared, want_hit in [(61, 61), (50, 37)]:  # a boundary, and the one before a divergence past it
        prompt = base[:shared] + random_prompt(10, shared, HYBRID_VOCAB)
        got, hit = greedy(cached, prompt, 2)
        assert hit == want_hit and got == greedy(plain, prompt, 2)[0]
    branch = base[:50] + random_prompt(12, 99, HYBRID_VOCAB)  # diverges at 50, where the previous one did
    got, hit = greedy(cached, branch, 2)
    assert hit == 50 and got == greedy(plain, branch, 2)[0]
    assert_flush_leaves_nothing(cached)


def checkpoint_states(eng, depth: int) -> list:
    """The conv and recurrent states of every GDN layer in the checkpoint at `depth` tokens."""
    node = next(n for n in eng.prefix_cache._nodes if n.depth == depth and n.has_checkpoint)
    states = eng.checkpoint_pool.states
    slot = states.slot(node)
    return [t[slot].clone() for t in states.conv + states.recurrent if t is not None]


def test_checkpoints_inside_a_chunk_do_not_cut_it(hybrid_folder):
    """Checkpoint positions inside a prefill chunk cost no step of their own: the forward keeps the GDN state
    there, and it is the state a chunk ending there leaves (to float32 rounding: the chunks' sums differ)."""
    prompt = random_prompt(90, 31, HYBRID_VOCAB)
    boundaries = (5, 37, 61)  # inside the 48-token chunks, and one shorter than the conv's history
    inside = engine(hybrid_folder, prefix_cache=True, max_total_tokens=640, checkpoint_slots=8,
                    checkpoint_interval_tokens=64, **SMALL)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    stream = inside.submit(prompt, params, boundaries=boundaries)
    steps = 0
    while not stream.finished:
        steps += inside.step()
    assert steps == 2  # 90 tokens in chunks of 48, whatever the 5 positions inside them (64 and 89 too)
    inside.scheduler.check()
    for depth in boundaries:
        ending = engine(hybrid_folder, prefix_cache=True, max_total_tokens=640, checkpoint_slots=8,
                        checkpoint_interval_tokens=64, **{**SMALL, "prefill_chunk_tokens": depth})
        greedy(ending, prompt[:depth + 1], 1, boundaries=(depth,))  # a chunk ends at the boundary
        rtol = logits_rtol(len(inside.loaded.model.model.layers), 48 * 16)
        for got, want in zip(checkpoint_states(inside, depth), checkpoint_states(ending, depth)):
            assert (got - want).abs().max() <= rtol * want.abs().max(), depth


def test_a_failed_step_keeps_no_reserved_checkpoint(hybrid_folder):
    """The checkpoint slots reserved for a chunk's snapshots go back to the pool when its step fails."""
    eng = engine(hybrid_folder, prefix_cache=True, max_total_tokens=640, checkpoint_slots=8,
                 checkpoint_interval_tokens=64, **SMALL)

    def fail(point):
        if point == "during_forward":
            raise RuntimeError("injected")

    eng.step_hook = fail
    stream = eng.submit(random_prompt(90, 41, HYBRID_VOCAB), SamplingParams(max_tokens=2), boundaries=(20, 37))
    eng.step()  # the first chunk, 48 tokens, with a snapshot at 20 and one at 37
    assert stream.finished and stream.drain()[-1].finish_reason == "error"
    eng.scheduler.check()
    assert eng.checkpoint_pool.used_slots == 0


def test_chat_boundaries_are_where_the_rendered_messages_end():
    """The positions the server passes are the token counts of the chat rendered up to each message (the
    template's own rendering is the oracle); a turn the template renders differently once later turns follow
    (Qwen3 drops an earlier answer's reasoning) gives none."""
    tok = read_gguf_tokenizer(default_model_path())
    messages = [{"role": "system", "content": "You survey towns."}, {"role": "user", "content": "The river?"},
                {"role": "assistant", "content": "It is wide.", "reasoning_content": "Rivers are wide."},
                {"role": "user", "content": "And the bridge?"}]
    for template, cut_turns in [(None, [1, 2, 3, 4]), ("qwen3.jinja", [1, 2, 4])]:
        if template is not None:
            tok.use_chat_template((Path(__file__).parent / "data" / "chat_templates" / template).read_text())
        ids, boundaries = tok.encode_chat_boundaries(messages)
        assert ids == tok.encode_chat(messages)
        want = [len(tok.encode_chat(messages[:i], add_generation_prompt=False)) for i in cut_turns]
        assert boundaries == want and all(ids[:b] == tok.encode_chat(messages[:i], add_generation_prompt=False)
                                          for b, i in zip(boundaries, cut_turns))


def test_a_hit_pins_its_pages_against_eviction(hybrid_pair):
    """While a request runs on a hit, its shared pages cannot be evicted, even when another request needs room."""
    cached, plain = hybrid_pair
    cached.flush_cache()
    base = random_prompt(5 * PAGE, 11, HYBRID_VOCAB)
    greedy(cached, random_prompt(3 * PAGE + 1, 13, HYBRID_VOCAB), 1)  # 3 pages the next requests must evict
    greedy(cached, base + [1], 1, boundaries=(len(base),))  # caches 5 pages and a checkpoint after them
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = cached.submit(base + [2, 3], params)
    cached.step()  # the hit is taken: the first 5 pages are shared
    big = random_prompt(640 - 6 * PAGE - 4, 12, HYBRID_VOCAB)  # with the first's 6 pages: the whole pool
    second = cached.submit(big, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while not (first.finished and second.finished):
        cached.step()
        cached.scheduler.check()
    outs = first.drain()
    assert outs[-1].cached_tokens == 5 * PAGE and cached.prefix_cache.evicted_pages_total >= 3
    assert tokens_of(outs) == greedy(plain, base + [2, 3], 4)[0]
    assert_flush_leaves_nothing(cached)


def test_boundaries_move_past_the_tokens_images_widen_into():
    """A boundary counted on the prompt as sent (one placeholder token per image) lands on the same message end
    once each image is widened into its tokens."""
    image = -1
    sent = [5, 6, image, 7, 8, image, 9]
    widened = [5, 6] + [image] * 5 + [7, 8] + [image] * 3 + [9]
    layout = SimpleNamespace(starts=[2, 9], lengths=[5, 3])
    moved = _widened((2, 4, 7), layout, len(widened))
    assert [widened[:b][-1] for b in moved] == [sent[:b][-1] for b in (2, 4, 7)] and moved == (2, 8, 13)
    assert _widened((2, 4, 7), None, len(sent)) == (2, 4, 7)
