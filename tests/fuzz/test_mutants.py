"""The mutation self-test (issue 54): every planted bug of mutants.py fails a case of the fixed slice. A mutant that
passes the whole slice fails this test, naming it: the proof has a hole there. The Q4_K scale mutant, which no slice
case can reach, must fail the GGUF oracle on llama-quantize's Q4_K fixture instead."""

from __future__ import annotations

import json

import pytest

from deltaserve.weights import load_checkpoint
from test_weights_gguf_quantized import DATA, logits_error, transformers_reference

from .mutants import MUTANTS, q4k_scale_nibble_swapped
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
