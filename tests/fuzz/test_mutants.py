"""The mutation self-test (issue 54): every planted bug of mutants.py fails a case of the fixed slice. A mutant that
passes the whole slice fails this test, naming it: the proof has a hole there. Two mutants no slice case can reach
must fail the oracle that can: a Q4_K scale bug the GGUF oracle on llama-quantize's Q4_K fixture, generated tokens'
positions after an image the engine's vision test (log-probs of every generated token against transformers')."""

from __future__ import annotations

import json

import pytest

from deltaserve.weights import load_checkpoint
from test_weights_gguf_quantized import DATA, logits_error, transformers_reference

from .mutants import MUTANTS, image_positions_late, q4k_scale_nibble_swapped
from .run import run_seed
from .test_fuzz import REGRESSIONS, SLICE


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_slice_catches_the_planted_bug(mutant):
    seeds = list(dict.fromkeys([*mutant.first_seeds, *SLICE, *REGRESSIONS]))
    with mutant.plant():
        for seed in seeds:
            result = run_seed(seed)
            if not result.ok:
                print(f"{mutant.name}: caught by seed {seed}: {result.failures[0]}")
                return
    pytest.fail(f"planted bug {mutant.fault!r} passed every case of the slice ({len(seeds)} seeds)")


def test_the_gguf_oracle_catches_a_q4k_scale_nibble_swap():
    path = DATA / "tiny-qwen35-q4_k.gguf"
    reference = transformers_reference(load_checkpoint(path))  # gguf-py's dequantization: the bug cannot reach it
    ids = json.loads(path.with_suffix(".llamacpp.json").read_text())["tokens"]
    with q4k_scale_nibble_swapped():
        error, bound = logits_error(path, reference, ids, dequantize=False)
    print(f"q4k_scale_nibble_swapped: packed logits {error:.3g} from transformers', {error / bound:.0f}x the bound")
    assert error > bound, "a Q4_K scale nibble swap passed the GGUF oracle"


def test_the_vision_oracle_catches_generated_positions_one_late(tmp_path):
    from test_engine_support import engine
    from test_engine_vision import greedy_with_images
    from vision_support import make_multimodal_checkpoint

    ref = make_multimodal_checkpoint(tmp_path)
    eng = engine(str(tmp_path), max_running_requests=4, max_image_pixels=96 * 96)
    with image_positions_late():
        ours, expected, worst = greedy_with_images(ref, eng, chunk=512)
    print(f"image_positions_late: generated log-probs up to {worst:.0f}x their bound, tokens "
          f"{'equal' if ours == expected else 'differ'}")
    assert worst > 1.0, "generated positions one late after an image passed the vision oracle"
