"""GGUF Q6_K and Q5_K matrices held as 8-bit codes (weights/gguf_int8.py, models/layers.Int8Linear / Int8Embedding),
never as floats: what a Q4_K_M file keeps beside its Q4_K tensors (the output matrix or the tied embedding, about half
of ffn_down / attn_v).

The fixture is llama-quantize's Q4_K file of the tiny Qwen3.5 hybrid (tests/data/gguf) rewritten by gguf-py's own
writer with some matrices replaced by random Q6_K / Q5_K blocks (sane float16 scales): a tied variant (no output
matrix; the 384-row embedding Q6_K, as a 2B-class Q4_K_M's 248K-row one) and an untied one (output Q6_K). The oracle
is gguf-py's `dequantize` on the same bytes: the held codes widen to its tensors bit for bit, the held model's logits
equal the dequantized model's to float32 rounding, and transformers on those weights bounds the engine's default
(int8 activations, the vocabulary projection included) within the activations' rounding.
"""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from deltaserve.engine.loader import load_model
from deltaserve.kernels.int8 import Int8Rows
from deltaserve.models.layers import Int8Embedding, Int8Linear
from deltaserve.weights import CheckpointError, load_checkpoint
from deltaserve.weights.gguf import load_gguf, tensor_name
from test_models_hybrid import prefill_logits
from tolerance import config_rtol

SOURCE = Path(__file__).parent / "data" / "gguf" / "tiny-qwen35-q4_k.gguf"
# tensor-name endings rewritten, and their type: Q6_K where llama-quantize's Q4_K_M puts it, Q5_K on two more
REWRITTEN = {"ffn_down.weight": Q.Q6_K, "ssm_out.weight": Q.Q6_K, "attn_v.weight": Q.Q5_K, "attn_qkv.weight": Q.Q5_K}
VARIANTS = {"tied": {"token_embd.weight": Q.Q6_K}, "untied": {"output.weight": Q.Q6_K}}
BLOCK_BYTES = {Q.Q6_K: 210, Q.Q5_K: 176, Q.Q2_K: 84}


def random_blocks(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 256 * block bytes] uint8: random codes and sub-block scales, float16 super-scales that keep the
    weights below ~0.1 (Q6_K's signed sub-block scales within +-24; Q5_K's d and dmin)."""
    blocks = rng.integers(0, 256, (rows * cols // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
    count = blocks.shape[0]

    def half(scale: float) -> np.ndarray:
        return (rng.random(count) * scale + scale / 4).astype(np.float16).view(np.uint8).reshape(count, 2)

    if kind == Q.Q6_K:
        blocks[:, 192:208] = rng.integers(-24, 25, (count, 16), dtype=np.int8).view(np.uint8)
        blocks[:, 208:210] = half(1e-4)
    elif kind == Q.Q5_K:
        blocks[:, 0:2], blocks[:, 2:4] = half(4e-5), half(4e-5)
    else:
        blocks[:, -4:-2], blocks[:, -2:] = half(1e-3), half(1e-3)
    return blocks.reshape(rows, -1)


def rewrite(dst: Path, kinds: dict[str, Q], drop: tuple[str, ...] = (), seed: int = 0) -> Path:
    """SOURCE with every tensor whose name ends in a key of `kinds` as random blocks of that type, `drop` left out."""
    reader = gguf.GGUFReader(SOURCE)
    writer = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    rng = np.random.default_rng(seed)
    for t in reader.tensors:
        if t.name in drop:
            continue
        kind = next((k for end, k in kinds.items() if t.name.endswith(end)), None)
        if kind is None:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        else:
            writer.add_tensor(t.name, random_blocks(kind, int(t.shape[1]), int(t.shape[0]), rng), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module", params=list(VARIANTS))
def path(request, tmp_path_factory):
    drop = ("output.weight",) if request.param == "tied" else ()
    return rewrite(tmp_path_factory.mktemp("kquant") / f"tiny-qwen35-{request.param}.gguf",
                   {**REWRITTEN, **VARIANTS[request.param]}, drop)


def test_fixture_holds_the_k_quant_types(path):
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down.weight"] == Q.Q6_K and types["blk.1.attn_v.weight"] == Q.Q5_K
    assert Q.Q4_K in types.values()
    assert (types.get("output.weight") == Q.Q6_K) != (types["token_embd.weight"] == Q.Q6_K)


def test_held_codes_widen_to_gguf_py_dequantization(path):
    """Every Q6_K / Q5_K tensor loaded packed (Int8Rows: rows in the checkpoint's order, out_proj's columns as a
    permutation) widens to the float tensor the dequantized load makes from gguf-py's dequantize, bit for bit."""
    floats = load_checkpoint(path).tensors
    _, held, _, _, _ = load_gguf(path, torch.float32, (), keep_int4=True)
    rows = {name: t for name, t in held.items() if isinstance(t, Int8Rows)}
    assert set(rows) == {tensor_name(t.name) for t in gguf.GGUFReader(path).tensors
                         if t.tensor_type in (Q.Q6_K, Q.Q5_K)}
    assert {t.group_size for t in rows.values()} == {16, 32}
    for name, t in rows.items():
        assert torch.equal(t.dequantize(), floats[name]), name


def test_held_model_equals_the_dequantized_model(path):
    import transformers

    dense, held = load_model(path).model, load_model(path, dequantize=False).model
    int8 = {n: m for n, m in held.named_modules() if type(m) in (Int8Linear, Int8Embedding)}
    assert int8["model.layers.0.mlp.down_proj"].group_size == 16
    assert int8["model.layers.1.self_attn.v_proj"].offsets is not None  # Q5_K's offsets kept
    assert ("model.embed_tokens" in int8) == path.name.endswith("-tied.gguf")
    ids = list(range(5, 40))
    config = transformers.Qwen3_5TextConfig(**{k: v for k, v in load_checkpoint(path).config.items()
                                               if k not in ("architectures", "model_type")})
    expected, got = prefill_logits(dense, ids), prefill_logits(held, ids)
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= config_rtol(config, len(ids))


@pytest.mark.parametrize("layout", ["dequantized", "packed"])
def test_ledger_weights_line_equals_resident_bytes(path, layout, monkeypatch):
    """Q6_K a byte a weight and a float32 scale per 16, Q5_K a float32 scale and offset per 32, the tied head over
    the Q6_K embedding sharing its codes: the ledger's weights line is what the loaded model holds, within 1%."""
    from deltaserve.budget import plan_budget, spec_from_checkpoint
    from test_weights_compressed_tensors import load_as, resident_bytes

    model, config, kind = load_as(path, layout, monkeypatch)
    budget = plan_budget(spec_from_checkpoint(path), config, device_total_bytes=4 * 2**30, device_kind=kind)
    predicted, measured = budget.line("weights").bytes, resident_bytes(model)
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


def test_int8_activations_agree_with_transformers_within_the_int8_bound(path):
    """The engine's default: the Q6_K / Q5_K linears (and, where the CPU has a dot-product instruction, the tied
    Q6_K vocabulary projection, its embedding read from the same panels) on the integer dot products, teacher-forced
    against transformers on gguf-py's dequantized weights within the float32 bound plus the activations' rounding
    (tests/int8_bound.py)."""
    from int8_bound import engine_greedy_problems, swapped_layers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine
    from deltaserve.kernels import int4_int8
    from deltaserve.models.layers import Int8DotLinear, PanelEmbedding

    loaded = load_checkpoint(path)
    ref = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{k: v for k, v in loaded.config.items()
                                                  if k not in ("architectures", "model_type")})).eval()
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in loaded.tensors.items()}, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m and m != "lm_head.weight"]
    assert torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight) == ("lm_head.weight" in missing)
    eng = Engine(EngineConfig(model=str(path), device="cpu", max_total_tokens=512, prefix_cache=False), log=None)
    model = eng.runner.model
    held = {n: m for n, m in model.named_modules() if type(m) is Int8DotLinear}
    assert swapped_layers(model) and held["model.layers.0.mlp.down_proj"].group_size == 16
    tied_panels = path.name.endswith("-tied.gguf") and int4_int8.isa() != "avx2"
    assert ("lm_head" in held) == (tied_panels or path.name.endswith("-untied.gguf"))
    assert (type(model.model.embed_tokens) is PanelEmbedding) == tied_panels
    prompt, steps = list(range(3, 19)), 12
    problems, decided = engine_greedy_problems(eng, ref, prompt, steps,
                                               config_rtol(ref.config, context=len(prompt) + steps - 1))
    assert problems == []
    assert decided >= steps // 4, "the bound decides too few positions to test anything"


def test_a_tensor_type_we_do_not_serve_is_refused_naming_it(tmp_path):
    """A Q2_K matrix (no reader here): the load stops at that tensor, one line naming it and its type."""
    bad = rewrite(tmp_path / "q2k.gguf", {"blk.1.ffn_up.weight": Q.Q2_K})
    with pytest.raises(CheckpointError, match=r"tensor blk\.1\.ffn_up\.weight has GGUF type Q2_K"):
        load_checkpoint(bad)
