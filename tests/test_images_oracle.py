"""An image file, end to end, against transformers on the same file (issue 42).

The checkpoint is the issue's: 16-pixel patches, a 16 x 16 position table, and a preprocessor_config.json written by
transformers' own image processor with a pixel range (32 x 32 .. 256 x 256) that is not the server's. Each image goes
(a) as a data: URL through a real server on 127.0.0.1 to the first token's log-probabilities, and (b) through our
preprocessing and model in process; the oracle is transformers' AutoImageProcessor (Qwen2VLImageProcessorPil) and
Qwen3_5ForConditionalGeneration reading the same file. The processor's pixel_values are a second input to our model:
equal pixels and equal logits from them say a difference lies in preprocessing, not in the tower.

Cases: sizes that need no resize (grids other than the table's and equal to it), down- and up-scaling, the pixel
limits' edges, 1:8, 8:1 and 200:1 images, RGBA, palette (with and without a transparent index), grayscale and JPEG.
Before the fix the server resized to its own --max-image-pixels / min_pixels instead of the checkpoint's, so every case
that the two ranges treat differently (512x512, 1280x160, 3600x18, 10x12) failed here.
"""

from __future__ import annotations

import base64
import math

import numpy as np
import openai
import pytest
import torch

from deltaserve.images import ImageLimits, PreprocessorSettings
from deltaserve.weights.hf import read_hf_tokenizer
from server_util import running_server
from vision_support import (IMAGE, ORACLE_MAX_PIXELS, ORACLE_MIN_PIXELS, SPECIAL, VISION_END, VISION_START,
                            ImageOracle, image_file, make_oracle_checkpoint)

# (width, height, kind): what each needs of the resize, with the checkpoint's 32-pixel factor and 1024..65536 range
CASES = [
    (96, 64, "RGB"),  # none: 4 x 6 patches against the 16 x 16 table
    (64, 96, "RGB"),  # none: 6 x 4
    (256, 256, "RGB"),  # none: 16 x 16, the table's own grid, at max_pixels
    (512, 512, "RGB"),  # down to max_pixels
    (300, 200, "RGB"),  # sides rounded to multiples of 32 (288 x 192)
    (1280, 160, "RGB"),  # 8:1, down
    (160, 1280, "RGB"),  # 1:8, down
    (512, 64, "RGB"),  # 8:1, none
    (64, 512, "RGB"),  # 1:8, none
    (3600, 18, "RGB"),  # 200:1: the thin side held at one factor, the area past max_pixels (the largest admitted)
    (10, 12, "RGB"),  # up to min_pixels
    (32, 32, "RGB"),  # exactly min_pixels
    (40, 50, "RGBA"),  # up, alpha over white
    (100, 70, "P"),
    (97, 61, "P+transparency"),
    (70, 100, "L"),
    (200, 130, "JPEG"),
]
CASE_IDS = [f"{w}x{h}-{k}" for w, h, k in CASES]


def case_file(case: tuple[int, int, str]) -> bytes:
    width, height, kind = case
    return image_file(width, height, width * 7 + height, kind)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vl_oracle")
    make_oracle_checkpoint(folder)
    return folder


@pytest.fixture(scope="module")
def oracle(folder):
    return ImageOracle(folder)


def test_the_checkpoint_s_pixel_range_is_read_as_transformers_reads_it(folder, oracle):
    settings = PreprocessorSettings.from_checkpoint(folder, {})
    assert (settings.min_pixels, settings.max_pixels) == (ORACLE_MIN_PIXELS, ORACLE_MAX_PIXELS)
    processor = oracle.processor
    assert (processor.size["shortest_edge"], processor.size["longest_edge"]) == (ORACLE_MIN_PIXELS, ORACLE_MAX_PIXELS)
    # the server's --max-image-pixels (default 1M) only lowers the top, never raises it past the checkpoint's
    assert settings.limits(8, 1000, 1024 * 1024).max_pixels == ORACLE_MAX_PIXELS
    lowered = settings.limits(8, 1000, 100 * 100)
    assert (lowered.min_pixels, lowered.max_pixels) == (ORACLE_MIN_PIXELS, 100 * 100)
    assert settings.limits(8, 1000, 20 * 20).min_pixels == 20 * 20


def test_the_older_spelling_of_the_pixel_range_overrides_size(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"min_pixels": 3136, "max_pixels": 12845056, "size": {"shortest_edge": 1, "longest_edge": 2}}')
    settings = PreprocessorSettings.from_checkpoint(tmp_path, {})
    assert (settings.min_pixels, settings.max_pixels) == (3136, 12845056)
    (tmp_path / "preprocessor_config.json").write_text("{}")  # transformers' class defaults
    settings = PreprocessorSettings.from_checkpoint(tmp_path, {})
    assert (settings.min_pixels, settings.max_pixels) == (56 * 56, 28 * 28 * 1280)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_pixels_and_logits_equal_transformers(oracle, case):
    data = case_file(case)
    ours, reference = oracle.pixels(data)
    assert [ours.grid.t, ours.grid.h, ours.grid.w] == reference["image_grid_thw"][0].tolist()
    # the same Pillow decode and resize, the same float64 scaling rounded once to float32: equal to the bit
    assert torch.equal(ours.patches, reference["pixel_values"].float())
    for reference_pixels in (False, True):
        got, expected, bound = oracle.compare(data, seed=case[1], use_reference_pixels=reference_pixels)
        assert (got - expected).abs().max().item() <= bound


def test_the_bound_sees_a_wrong_resize(oracle):
    """The comparison can fail: the 512 x 512 image resized by the server's own old range (64 x 64 .. 1024 x 1024,
    the code before the fix) is 32 x 32 patches against transformers' 16 x 16, and its logits leave the bound."""
    data = case_file((512, 512, "RGB"))
    old = oracle.limits
    oracle.limits = ImageLimits()
    try:
        got, expected, bound = oracle.compare(data, seed=512)
    finally:
        oracle.limits = old
    assert (got - expected).abs().max().item() > 10 * bound


def test_random_images_equal_transformers(oracle):
    """The fuzzer's draw (vision_support.ImageOracle.random_case), a fixed slice."""
    rng = np.random.default_rng(42)
    for _ in range(6):
        got, expected, bound, what = oracle.random_case(rng)
        assert (got - expected).abs().max().item() <= bound, what


STEPS_SERVED = [c for c in CASES if c[2] in ("RGB", "JPEG", "P+transparency")]


@pytest.fixture(scope="module")
def served(folder, tmp_path_factory):
    # float32 KV: the server's arithmetic is float32 throughout, as the bound assumes (the float16 KV default is
    # held to the oracle in test_engine_kv16); --max-image-pixels left at its default, above the checkpoint's range
    with running_server(tmp_path_factory.mktemp("vl_oracle_server"), "--model", str(folder), "--device", "cpu",
                        "--max-total-tokens", "4096", "--kv-dtype", "float32", "--served-model-name", "x") as server:
        yield server


@pytest.mark.parametrize("case", STEPS_SERVED, ids=[f"{w}x{h}-{k}" for w, h, k in STEPS_SERVED])
def test_a_served_image_is_answered_as_transformers_answers(folder, oracle, served, case):
    data = case_file(case)
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    url = f"data:image/{'jpeg' if case[2] == 'JPEG' else 'png'};base64,{base64.b64encode(data).decode()}"
    reply = client.chat.completions.create(
        model="x", max_tokens=1, temperature=0, logprobs=True, top_logprobs=20,
        messages=[{"role": "user", "content": [{"type": "text", "text": "t5 t9 t14"},
                                               {"type": "image_url", "image_url": {"url": url}}]}])
    # transformers on the chat the server renders: the template, the placeholder widened to the processor's grid
    tok = read_hf_tokenizer(folder)
    ids = tok.encode_chat([{"role": "user", "content": "t5 t9 t14" + SPECIAL[VISION_START] + SPECIAL[IMAGE] +
                                                       SPECIAL[VISION_END]}])
    _, reference = oracle.pixels(data)
    tokens = int(reference["image_grid_thw"][0].prod()) // 4
    k = ids.index(IMAGE)
    ids = ids[:k] + [IMAGE] * tokens + ids[k + 1:]
    assert reply.usage.prompt_tokens == len(ids)
    with torch.no_grad():
        logits = oracle.ref(**oracle._reference_inputs(ids, reference)).logits[0, -1]
    # |d logit| <= b gives |d log-softmax| <= 2b
    bound = 2 * oracle.rtol(len(ids), tokens * 4) * logits.abs().max().item()
    expected = torch.log_softmax(logits, -1)
    first = reply.choices[0].logprobs.content[0]
    assert len(first.top_logprobs) == 20
    for top in first.top_logprobs:
        token_id = tok.encode(top.token)[0]
        assert abs(top.logprob - expected[token_id].item()) <= bound, (top.token, top.logprob, bound)
    assert tok.encode(first.token)[0] == int(expected.argmax())
    assert math.isfinite(first.logprob)


def tower_peak_bytes(model, patches: torch.Tensor, grid) -> int:
    """The most bytes torch's CPU allocator held at once while the tower encoded one image, from the profiler's
    record of every allocation and free (kernels' own scratch included), counted from the start of the call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.inference_mode():
            model.encode_images(patches, [grid])
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in events:  # a free is a negative size
        held += nbytes
        peak = max(peak, held)
    return peak


def test_the_largest_admitted_image_is_the_thin_one_and_the_ledger_counts_its_tokens(folder):
    from deltaserve.budget import spec_from_checkpoint
    from deltaserve.images import smart_resize

    vision = spec_from_checkpoint(folder).vision
    factor = vision.patch_size * vision.merge_size
    largest = 0
    for short in range(1, 200):
        for ratio in (200, 199.5, 150, 100, 16, 1):
            long = int(short * ratio)
            for min_pixels in (ORACLE_MIN_PIXELS, ORACLE_MAX_PIXELS):
                h, w = smart_resize(short, long, factor, min_pixels, ORACLE_MAX_PIXELS)
                largest = max(largest, h * w // factor ** 2)
    assert largest > ORACLE_MAX_PIXELS // factor ** 2  # 113 tokens where max_pixels alone says 64
    assert largest <= vision.max_image_tokens(ORACLE_MAX_PIXELS) <= largest + 1


def test_the_vision_workspace_line_holds_the_tower_at_the_largest_admitted_image(folder, oracle):
    """The ledger's vision_workspace line against the tower's measured peak (its input patches included) on the image
    the limits admit that costs most: 3600 x 18 pixels, 2 x 226 patches. The line may not be short, nor more than a
    quarter over (the profiler sees torch's allocations; the flash kernel's per-thread blocks: fixed to 2 threads)."""
    from deltaserve.budget import plan_budget, spec_from_checkpoint
    from deltaserve.config import EngineConfig

    spec = spec_from_checkpoint(folder)
    config = EngineConfig(model=str(folder), device="cpu", max_image_pixels=ORACLE_MAX_PIXELS,
                          max_running_requests=1)
    line = plan_budget(spec, config, device_total_bytes=1 << 34, device_kind="cpu").line("vision_workspace").bytes
    prepared, _ = oracle.pixels(case_file((3600, 18, "RGB")))
    assert prepared.tokens(2) == spec.vision.max_image_tokens(ORACLE_MAX_PIXELS) - 1
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        peak = tower_peak_bytes(oracle.ours, prepared.patches, prepared.grid)
    finally:
        torch.set_num_threads(threads)
    measured = peak + prepared.patches.numel() * prepared.patches.element_size()
    assert measured <= line <= 1.25 * measured, (measured, line)
