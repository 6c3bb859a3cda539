"""The ledger's weights line on CPU with --activation-dtype int8 (issue 53): the layers the int8-activation swap takes
held in its panels, GGUF's K-quants as compactly as the file holds them (weights/gguf_panels.py), and the load, which
holds the weights packed until the swap, checked against the usable memory.

The fixtures are bench/make_real_size.py's Qwen3.5-shaped files at small sizes (random blocks written by gguf-py in
the family's names and shapes): a tied Q4_K_M (Q4_K body, Q5_K attn_qkv, Q6_K ffn_down / attn_v on the layers
llama-quantize gives more bits, the Q6_K tied embedding) and an untied IQ4_XS (Q6_K output). The oracle of the
formulas is the super form's own tensor shapes, written out here from the issue: per 16-row panel and 256-column
super-block 16 float32 super-scales then G x 16 int8 sub-scales, offsets the same again; GGUF's tensor infos give
each tensor's type and shape; the swapped model's own bytes equal the line.
Planted and seen to fail (2026-12-07): Q5_K's offsets left out of its compact form, the tied Q6_K table priced as
packed where its head is swapped, the kernel's refusal of a 2-row matrix ignored, the panels priced under
--activation-dtype float32, the load's check dropped (and fitting blind to it), the loaded form priced as the
panels, the CPU flags read by the compiler's names (avx512vnni, avxvnni).
"""

import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from deltaserve.budget import BudgetError, plan_budget, spec_from_checkpoint
from deltaserve.budget.fit import CPU_FIT_MEM_FRACTION
from deltaserve.budget.lines import CONSUMER_LINES, draft_ledger
from deltaserve.config import EngineConfig, MiB
from deltaserve.kernels import int4_int8

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(hidden=256, layers=4, ffn=512, heads=2, kv_heads=1, k_heads=2, v_heads=2)  # ssm_alpha: 2 rows, declined
SMALL = dict(hidden=1024, layers=8, ffn=3072, heads=4, kv_heads=1, k_heads=4, v_heads=4)
# the super form, per row and super-block: code bits, G int8 sub-scales, offsets stored
FORM = {Q.Q4_K: (4, 8, True), Q.IQ4_XS: (4, 8, False), Q.Q6_K: (6, 16, False), Q.Q5_K: (6, 16, True)}
# the packed form the load holds (and the swap keeps where it declines): bytes a weight, scale bytes per group, group
PACKED = {Q.Q4_K: (0.5, 8, 32), Q.IQ4_XS: (0.5, 4, 32), Q.Q6_K: (1, 4, 16), Q.Q5_K: (1, 8, 32)}
LEANER = dict(max_total_tokens=64, context_length=64, max_running_requests=1, prefill_chunk_tokens=16,
              prefix_cache=False, speculative="off")  # a ledger whose other lines stay small beside the weights


def make(tmp_path_factory, size: dict, mix: str, vocab: int, tied: bool) -> Path:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import make_real_size
    finally:
        sys.path.remove(str(ROOT / "bench"))
    saved = make_real_size.VOCAB
    make_real_size.SIZES["test"], make_real_size.VOCAB = {**size, "tied": tied}, vocab
    try:
        return make_real_size.make("test", mix, tmp_path_factory.mktemp("panels") / f"qwen35-{mix}.gguf")
    finally:
        make_real_size.VOCAB = saved
        del make_real_size.SIZES["test"]


@pytest.fixture(scope="module", params=[("q4_k_m", True), ("iq4_xs", False)], ids=["q4_k_m-tied", "iq4_xs-untied"])
def tiny(request, tmp_path_factory):
    mix, tied = request.param
    return make(tmp_path_factory, TINY, mix, 1024, tied)


def expected_panels(path: Path, tied_heads: bool) -> tuple[int, int]:
    """(the weights held after the swap, as loaded before it) from the tensor infos and the issue's forms."""
    panels = loaded = 0
    reader = GGUFReader(path)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    for t in reader.tensors:
        if t.tensor_type == Q.F32:
            panels += 4 * int(t.n_elements)
            loaded += 4 * int(t.n_elements)
            continue
        k, n = (int(d) for d in t.shape)
        per_weight, scale_bytes, group = PACKED[t.tensor_type]
        packed = int(n * k * per_weight) + n * k // group * scale_bytes + (64 if t.tensor_type == Q.IQ4_XS else 0)
        loaded += packed
        bits, g, offsets = FORM[t.tensor_type]
        table = 16 if t.tensor_type == Q.IQ4_XS else 0
        # the super form: codes, then [N / 16, K / 256, 64 + 16 G] int8 of scales (and as much of offsets)
        compact = n * k * bits // 8 + (n // 16) * (k // 256) * (64 + 16 * g) * (2 if offsets else 1) + table
        embedding = t.name.startswith("token_embd")
        swapped = n % 16 == 0 and (not embedding or (tied and tied_heads and t.tensor_type == Q.Q6_K))
        if embedding and t.tensor_type == Q.IQ4_XS:
            swapped = False  # an untied 4-bit table is looked up packed
        panels += compact if swapped else packed
    return panels, loaded


def cpu(path: Path, tied_heads: bool, **settings):
    """The plan on CPU with --compact-weights (unless `settings` say otherwise)."""
    spec = spec_from_checkpoint(path, tied_heads=tied_heads)
    return plan_budget(spec, EngineConfig(max_total_tokens=64, **{"compact_weights": True, **settings}),
                       device_total_bytes=4 * 2**30, device_kind="cpu")


@pytest.mark.parametrize("tied_heads", [True, False], ids=["vnni", "avx2"])
def test_weights_line_holds_the_compact_panels(tiny, tied_heads):
    """Per tensor the compact form where the swap takes it (a 16-row multiple; the tied Q6_K table only where the
    head is swapped: then held once, in its panels), else the packed form; the reason says the load's size."""
    panels, loaded = expected_panels(tiny, tied_heads)
    weights = cpu(tiny, tied_heads).line("weights")
    assert weights.bytes == panels, (weights.bytes, panels)
    assert panels < loaded and f"loaded as {-(-loaded // MiB):,} MiB (packed) before the swap" in weights.reason
    assert cpu(tiny, tied_heads, activation_dtype="float32").line("weights").bytes == loaded
    assert cpu(tiny, tied_heads, compact_weights=False).line("weights").bytes == loaded  # the panels: moved bytes


def test_other_devices_and_forms_keep_their_line(tiny):
    """--activation-dtype float32 holds the load's form; CUDA (no swap) and --dequantize-weights are not touched."""
    spec = spec_from_checkpoint(tiny, tied_heads=True)
    for settings, kind in [(dict(activation_dtype="float32"), "cpu"), (dict(device="cuda", dtype="bfloat16"), "cuda"),
                           (dict(dequantize_weights=True), "cpu")]:
        config = EngineConfig(max_total_tokens=64, **settings)
        draft = draft_ledger(spec, config, 4 * 2**30, kind)
        assert draft.lines["weights"][0] + draft.lines["runtime"][0] == draft.load_bytes
        assert "before the swap" not in draft.lines["weights"][1]


def test_tied_heads_read_from_the_cpu_flags_agree_with_the_native_build():
    """The ledger's answer (no compiler: /proc/cpuinfo's flags as -march=native sees them) is the loaded native
    build's: the tied head is priced as the swap will hold it."""
    if int4_int8.load() is None:
        pytest.skip("the int8 dot-product kernel cannot be built here")
    assert int4_int8.swaps_tied_heads() == int4_int8.swaps_tied_heads(int4_int8.isa())
    assert not int4_int8.swaps_tied_heads("avx2") and int4_int8.swaps_tied_heads("avx_vnni")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make(tmp_path_factory, SMALL, "q4_k_m", 16384, True)


def test_load_form_beyond_the_usable_memory_is_refused_or_fitted(small):
    """A host where the panels and every pool fit but the load's packed form does not: `plan` refuses with the load's
    arithmetic where --mem-fraction is given, and fitting raises it where it is not."""
    spec = spec_from_checkpoint(small, tied_heads=True)
    config = EngineConfig(mem_fraction=0.5, compact_weights=True, **LEANER)
    sized = draft_ledger(spec, config, 64 * 2**30, "cpu")
    lines = sum(sized.lines[n][0] for n in (*CONSUMER_LINES, "runtime"))  # all usable must hold (the pool fixed)
    assert lines + 4 * MiB < sized.load_bytes, "the fixture must load more than its lines hold, or it proves nothing"
    total = lines + sized.load_bytes  # usable, half of it, midway between the lines and the load
    draft = draft_ledger(spec, config, total, "cpu")
    assert lines < draft.usable < draft.load_bytes and draft.load_short
    assert draft.shortfall == draft.load_bytes - draft.usable and draft.required == draft.load_bytes
    with pytest.raises(BudgetError) as err:
        plan_budget(spec, config, device_total_bytes=total, device_kind="cpu")
    message = str(err.value)
    assert "the load holds the weights as loaded" in message and "Fix: raise --mem-fraction" in message
    fitted = plan_budget(spec, EngineConfig(compact_weights=True, **LEANER), device_total_bytes=total,
                         device_kind="cpu")
    assert fitted.fitted == {"mem_fraction": CPU_FIT_MEM_FRACTION} and "the load's peak" in fitted.notes[0]
    assert fitted.required_bytes == draft.load_bytes  # what must be free at start covers the load


def test_swapped_model_holds_the_weights_line(tiny):
    """The model the engine serves (loaded, then swapped as the engine swaps it) holds the ledger's line, within 1%."""
    from deltaserve.engine.loader import load_model, return_freed_memory
    from deltaserve.models.int8_activations import use_int8_activations
    from test_weights_compressed_tensors import resident_bytes

    if int4_int8.load() is None:
        pytest.skip("the int8 dot-product kernel cannot be built here")
    model = load_model(tiny, dequantize=False).model
    use_int8_activations(model, release=return_freed_memory, in_place=True, compact=True)
    predicted = cpu(tiny, int4_int8.swaps_tied_heads(int4_int8.isa())).line("weights").bytes
    measured = resident_bytes(model)
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


def test_compact_weights_are_fitted_only_where_the_model_needs_the_memory(small):
    """--compact-weights left unset: off where the model fits in its packed form (decode is faster so), fitted on,
    first, at the smallest host where only the compact form fits (the pools need what it frees); given off, it stays
    off there and the plan is refused."""
    spec = spec_from_checkpoint(small, tied_heads=True)
    settings = dict(mem_fraction=0.5, context_length=8192, max_running_requests=1, prefix_cache=False,
                    speculative="off")

    def fits(total: int, **given) -> bool:
        try:
            plan_budget(spec, EngineConfig(**settings, **given), device_total_bytes=total, device_kind="cpu")
            return True
        except BudgetError:
            return False

    roomy = plan_budget(spec, EngineConfig(**settings), device_total_bytes=64 * 2**30, device_kind="cpu")
    assert "compact_weights" not in roomy.fitted
    total = next(t * 16 * MiB for t in range(8, 4096) if fits(t * 16 * MiB, compact_weights=True))
    assert not fits(total, compact_weights=False), "the fixture must need the compact form somewhere"
    fitted = plan_budget(spec, EngineConfig(**settings), device_total_bytes=total, device_kind="cpu")
    assert fitted.fitted == {"compact_weights": True} and "--compact-weights (" in fitted.notes[0]
