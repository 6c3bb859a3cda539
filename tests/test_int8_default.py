"""int8 activations, the CPU default for packed 4-bit weights (issue 41), on the built-in model.

The engine's default settings take every packed 4-bit layer of SmolLM2's Q4_1 file onto the int8 dot-product kernel,
and its greedy answer is held to transformers on the same dequantized weights (the float32 path's oracle: the packed
float32 path equals it to float32 rounding, test_models_dense.py): transformers is run on the engine's tokens, each
chosen token's log-probability must lie within the float32 bound (tests/tolerance.py) plus the activations' rounding
propagated through the network (tests/int8_bound.py), and a greedy token may differ from transformers' argmax only
where their logit gap is within those bounds, i.e. wherever the float32 margin exceeds the bound the tokens agree.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from int8_bound import engine_greedy_problems, swapped_layers
from test_engine_dense import TEXT
from tolerance import config_rtol

from deltaserve.budget.load import default_model_path
from deltaserve.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.kernels import int4_int8
from deltaserve.models.int8_activations import use_int8_activations
from deltaserve.models.layers import Int4Linear, Int8Embedding, PanelEmbedding

STEPS = 8


@pytest.fixture(scope="module")
def default_engine():
    logs: list[str] = []
    eng = Engine(EngineConfig(device="cpu", max_total_tokens=2048, prefix_cache=False), log=logs.append)
    return eng, logs


def test_the_default_takes_packed_layers_onto_int8(default_engine):
    eng, _ = default_engine
    assert eng.config.activation_dtype == "int8"
    layers = swapped_layers(eng.runner.model)
    # SmolLM2's 30 layers x 7 projections, and its vocabulary projection (tied to the Q8_0 embedding) where the CPU
    # has a dot-product instruction (models/int8_activations.py)
    model, vnni = eng.runner.model, int4_int8.isa() != "avx2"
    assert len(layers) == 210 + vnni and ("lm_head" in layers) == vnni
    assert not any(type(m) is Int4Linear for m in model.modules())
    # the table is held once: the embedding reads the head's panels, or the head the table's codes
    embedding = model.model.embed_tokens
    assert type(embedding) is (PanelEmbedding if vnni else Int8Embedding)
    assert embedding.codes is model.lm_head.codes


def test_the_tied_table_looks_up_the_rows_it_held_before_the_swap():
    """The embedding's rows from the head's panels are the Q8_0 table's own rows, bit for bit."""
    plain = Engine(EngineConfig(device="cpu", max_total_tokens=256, prefix_cache=False, activation_dtype="float32"),
                   log=None).runner.model.model.embed_tokens
    assert type(plain) is Int8Embedding
    ids = torch.tensor([[0, 1, 15, 16, 17], [49151, 4096, 33, 777, 12345]])
    model = Engine(EngineConfig(device="cpu", max_total_tokens=256, prefix_cache=False), log=None).runner.model
    use_int8_activations(model, tied_heads=True)  # what the default does on a CPU with a dot-product instruction
    assert type(model.model.embed_tokens) is PanelEmbedding
    assert torch.equal(model.model.embed_tokens(ids), plain(ids))


def test_greedy_tokens_agree_with_transformers_where_the_margin_exceeds_the_int8_bound(default_engine):
    eng, _ = default_engine
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    prompt = eng.tokenizer.encode(TEXT)[:40]
    problems, decided = engine_greedy_problems(eng, hf, prompt, STEPS,
                                               config_rtol(hf.config, context=len(prompt) + STEPS - 1))
    assert problems == []
    assert decided >= STEPS // 2, "the bound decides too few positions to test anything"
