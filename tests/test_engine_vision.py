"""The engine with images on a tiny random Qwen3.5 multimodal checkpoint, transformers as the oracle.

Images are encoded in the step loop, one per step; a prefill chunk stops before an image not encoded yet. These
tests hold the whole path (widened placeholders, M-RoPE positions through chunked prefill and decode, the prefix
cache keyed by pixels, the ledger's tower line) to transformers' Qwen3_5ForConditionalGeneration.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.request import SamplingParams
from deltaserve.engine.scheduler import RequestRefused
from deltaserve.images import preprocess
from test_engine_support import engine, tokens_of
from tolerance import logits_rtol
from vision_support import (IMAGE, MERGE, VISION_END, VISION_START, image_prompt, make_multimodal_checkpoint,
                            oracle_inputs, picture, png)

GREEDY = dict(temperature=0, ignore_eos=True)
STEPS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_vl_engine")
    return folder, make_multimodal_checkpoint(folder)


@pytest.fixture(scope="module")
def vl(checkpoint):
    folder, ref = checkpoint
    return ref, engine(str(folder), max_running_requests=4, max_image_pixels=96 * 96)


def prepared(eng, size: tuple[int, int], seed: int):
    return preprocess(png(picture(*size, seed=seed)), eng.image_limits, eng.image_settings)


def placeholder_prompt(grids, seed: int) -> list[int]:
    """The client's prompt: one image token per image (the engine widens it into the image's tokens)."""
    ids = image_prompt(grids, seed)
    return [t for k, t in enumerate(ids) if t != IMAGE or ids[k - 1] != IMAGE]


def reference_greedy(ref, ids: list[int], images, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' full forward at every step (its cached generate drifts on near-ties, see test_engine_hybrid):
    the greedy tokens and each step's logits."""
    ids, out, logits = list(ids), [], []
    with torch.no_grad():
        for _ in range(steps):
            inputs = oracle_inputs(ids, images)
            logits.append(ref(**inputs).logits[0, -1])
            out.append(int(logits[-1].argmax()))
            ids.append(out[-1])
    return out, logits


def rtol(ref, context: int, patches: int) -> float:
    """tests/tolerance.py's bound over the tower's blocks and the language model's layers (as vision_support's
    ImageOracle.rtol, for this checkpoint's sizes)."""
    text, v = ref.config.text_config, ref.config.vision_config
    widths = [text.hidden_size, text.intermediate_size, 64 * text.linear_key_head_dim, context, patches,
              v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2,
              3 * v.temporal_patch_size * v.patch_size ** 2]
    return logits_rtol(text.num_hidden_layers + v.depth + 1, max(widths))


def greedy_with_images(ref, eng, chunk: int) -> tuple[list[int], list[int], float]:
    """Two images read in chunks of `chunk` tokens, then STEPS greedy tokens: (ours, transformers', the largest
    |our log-prob - transformers'| of a generated token over its bound: 2 x the logits bound, since
    |d logit| <= b gives |d log-softmax| <= 2b). The decode steps after the images are where an M-RoPE offset
    of the generated tokens would show (tests/fuzz/mutants.py plants one)."""
    sizes = [(40, 24), (61, 97)]
    images = [prepared(eng, s, seed=s[0]) for s in sizes]
    ids = placeholder_prompt([i.grid for i in images], seed=4)
    eng.scheduler.prefill_chunk_tokens = chunk  # 7: images read over several chunks, encoded between steps
    try:
        out = run_all_images(eng, [(ids, SamplingParams(max_tokens=STEPS, logprobs=0, **GREEDY), images)])[0]
    finally:
        eng.scheduler.prefill_chunk_tokens = 512
    full = eng._expand_images(ids, images)[0]
    assert out[-1].prompt_tokens == len(full)
    expected, logits = reference_greedy(ref, full, [picture(*s, seed=s[0]) for s in sizes], STEPS)
    patches = max(i.grid.patches for i in images)
    worst = 0.0
    for lp, row in zip([lp for o in out for lp in o.logprobs], logits):
        bound = 2 * rtol(ref, len(full) + STEPS, patches) * row.abs().max().item()
        worst = max(worst, abs(lp.logprob - torch.log_softmax(row, -1)[lp.token_id].item()) / bound)
    return tokens_of(out), expected, worst


def test_placeholder_prompt_has_one_image_token_per_image(vl):
    _, eng = vl
    images = [prepared(eng, (40, 24), 1), prepared(eng, (24, 40), 2)]
    ids = placeholder_prompt([i.grid for i in images], seed=3)
    assert ids.count(IMAGE) == 2
    full, layout = eng._expand_images(ids, images)
    assert full.count(IMAGE) == sum(i.tokens(MERGE) for i in images)
    assert full == image_prompt([i.grid for i in images], seed=3)


@pytest.mark.parametrize("chunk", [512, 7])
def test_greedy_with_images_matches_transformers(vl, chunk):
    ref, eng = vl
    ours, expected, worst = greedy_with_images(ref, eng, chunk)
    assert ours == expected
    print(f"chunk {chunk}: generated log-probs within {worst:.3f}x their bound")
    assert worst <= 1.0, f"a generated token's log-prob is {worst:.2f}x its bound from transformers'"
    eng.scheduler.check()
    assert eng.kv_pool.used_pages == 0


def run_all_images(eng, submitted):
    streams = [eng.submit(ids, params, images=images) for ids, params, images in submitted]
    outputs = [[] for _ in streams]
    while not all(s.finished for s in streams):
        eng.step()
        for stream, out in zip(streams, outputs):
            out.extend(stream.drain())
    return outputs


def test_batch_with_images_equals_each_alone_and_leaves_text_streams_alone(vl):
    _, eng = vl
    params = SamplingParams(max_tokens=STEPS, **GREEDY)
    a = [prepared(eng, (40, 24), 11)]
    b = [prepared(eng, (97, 61), 12), prepared(eng, (32, 32), 13)]
    requests = [(placeholder_prompt([i.grid for i in a], 5), params, a),
                (list(range(3, 40)), params, None),
                (placeholder_prompt([i.grid for i in b], 6), params, b),
                (list(range(50, 61)), params, None)]
    alone = [tokens_of(run_all_images(eng, [r])[0]) for r in requests]
    eng.scheduler.prefill_chunk_tokens = 16  # images and text prompts share steps, decode beside prefill
    try:
        together = [tokens_of(o) for o in run_all_images(eng, requests)]
    finally:
        eng.scheduler.prefill_chunk_tokens = 512
    assert together == alone
    assert len({tuple(t) for t in together}) == 4
    eng.scheduler.check()


def test_refusals_name_the_problem(vl, checkpoint):
    _, eng = vl
    image = prepared(eng, (40, 24), 1)
    with pytest.raises(RequestRefused, match="2 image placeholder tokens for 1 images"):
        eng.submit([1, VISION_START, IMAGE, VISION_END, IMAGE, 2], SamplingParams(max_tokens=2), images=[image])
    with pytest.raises(RequestRefused, match="over the limit of 8"):
        eng.submit([1, IMAGE] * 9, SamplingParams(max_tokens=2), images=[image] * 9)
    text_only = engine(str(checkpoint[0]), language_model_only=True)
    with pytest.raises(RequestRefused, match="--language-model-only"):
        text_only.submit([1, IMAGE, 2], SamplingParams(max_tokens=2), images=[image])
    assert text_only.budget.line("vision_weights").bytes == 0
    assert text_only.measured_bytes()["vision_weights"] == 0


def test_ledger_lines_for_the_tower_match_what_is_held(vl):
    _, eng = vl
    predicted = eng.budget.line("vision_weights").bytes
    assert predicted > 0
    assert eng.measured_bytes()["vision_weights"] == predicted
    assert eng.measured_bytes()["weights"] == eng.budget.line("weights").bytes
    assert eng.budget.line("vision_workspace").bytes > 0


def test_prefix_cache_hits_an_identical_image_and_misses_a_different_one(checkpoint):
    folder, _ = checkpoint
    eng = engine(str(folder), prefix_cache=True, page_size=4, max_image_pixels=96 * 96)
    params = SamplingParams(max_tokens=4, **GREEDY)
    image = prepared(eng, (61, 97), 21)
    other = prepared(eng, (61, 97), 22)  # same size: the same token ids, different pixels
    assert image.grid == other.grid and image.digest != other.digest
    ids = placeholder_prompt([image.grid], seed=8)
    first = run_all_images(eng, [(ids, params, [image])])[0]
    again = run_all_images(eng, [(ids, params, [image])])[0]
    different = run_all_images(eng, [(ids, params, [other])])[0]
    start = ids.index(IMAGE)
    assert first[-1].cached_tokens == 0
    assert again[-1].cached_tokens > start + image.tokens(MERGE)  # past the image
    assert tokens_of(again) == tokens_of(first)
    assert different[-1].cached_tokens <= start  # the text before the image at most
    fresh = engine(str(folder), max_image_pixels=96 * 96)
    assert tokens_of(different) == tokens_of(run_all_images(fresh, [(ids, params, [other])])[0])
