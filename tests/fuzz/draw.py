"""Drawing a fuzz case from a seed: a valid transformers config of one family, a checkpoint format, engine
settings whose boundaries (prefill chunk, KV page, GDN checkpoint interval) fall at tiny lengths, and prompts that
cross them. Every draw is valid for transformers by construction; nothing here catches an exception."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

VOCAB = 160  # the word-level tokenizer of tests/test_models_hybrid.py; GGUF cases use write_gguf's 257
GGUF_VOCAB = 257
GGUF_CONTEXT = 128  # write_gguf's context_length

FAMILIES = ("llama", "qwen3", "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")
GDN_FAMILIES = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")
MOE_FAMILIES = ("qwen3_next", "qwen3_5_moe_text")
# Not in the set the fused decode block serves (16/32/64/128): kept in the draw on purpose (issue 37's first defect).
GDN_VALUE_HEAD_DIMS = (16, 24, 32, 48, 64, 80, 128)
GDN_KEY_HEAD_DIMS = (16, 32, 48, 64, 128)
ATTENTION_HEAD_DIMS = (32, 48, 64, 80, 96, 128, 256)
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")  # those gguf-py quantizes itself
# The KV cache's storage: auto is the CPU default (float16 under float32 arithmetic, config.cpu_kv_dtype), drawn most
KV_DTYPES = ("float32", "auto", "auto", "bfloat16")
# Multimodal families: a seed carries one beside its text case one time in IMAGE_CASE_RATE (its own draw, "image"),
# compared through tests/vision_support.ImageOracle (issues 37 and 42)
IMAGE_FAMILIES: tuple[str, ...] = ("qwen3_5_vl",)
IMAGE_CASE_RATE = 0.1
# Prompt-lookup speculation (issue 40): one text case in SPECULATIVE_RATE runs with `--speculative ngram` and 1..4
# drafts a step (its own draw, "speculative"), so the verify rows' native path (decode rows chained through the GDN
# state, snapshots) meets every drawn shape; speculation is lossless, so the oracle and its bound are unchanged
SPECULATIVE_RATE = 0.3
# The checkpoint's own MTP head (issue 40; what --speculative auto picks where a head is): one Qwen3.5 safetensors
# case in MTP_RATE of those not drawn for prompt lookup gets a random head (tests/test_speculative_mtp.add_mtp_head)
# and runs `--speculative mtp` with 1..4 drafts a step (its own draw, "mtp"): the head's passes over several
# requests' rows, its chained drafts written ahead, their rejections; lossless, so the oracle is unchanged
MTP_RATE = 0.7
FIXED_DRAFTS_RATE = 0.75
# Activations rounded to int8 (issue 41, the CPU default for packed 4-bit and int8 weights): one case in INT8_RATE of
# those that keep 4-bit weights packed or 8-bit ones int8 runs --activation-dtype int8 (its own draw, "activation"), compared within the
# activations' rounding propagated (tests/int8_bound.py); every other case runs float32, the exact path. Not the MoE
# families: a router's top-k choice is discontinuous, so a rounding that flips it moves a log-probability by O(1)
# where no first-order bound reaches (and transformers holds their experts as one fused parameter, no module whose
# input the bound could perturb).
INT8_RATE = 0.5


@dataclass(frozen=True)
class Format:
    """How the checkpoint is written: kind is one of safetensors, compressed_tensors, gptq, awq, gguf."""

    kind: str
    dtype: str = "float32"  # safetensors: float32 | bfloat16
    bits: int = 4  # compressed_tensors
    group: int | None = None  # None: one scale per output channel
    symmetric: bool = True
    packed: bool = True  # compressed_tensors: pack-quantized (else int-quantized, one int8 a value)
    int8_embedding: bool = False
    act_order: bool = False  # gptq: a g_idx on one module in each layer
    gguf_types: tuple[str, ...] = ()  # gguf: the type of each 2-D tensor, drawn per tensor in name order

    def label(self) -> str:
        if self.kind == "safetensors":
            return f"safetensors-{self.dtype}"
        if self.kind == "compressed_tensors":
            return f"ct-w{self.bits}{'' if self.symmetric else '-asym'}-{'packed' if self.packed else 'int'}"
        if self.kind == "gguf":
            return "gguf-" + "+".join(sorted(set(self.gguf_types)))
        return self.kind


@dataclass(frozen=True)
class Request:
    """One request: its prompt length, tokens to generate, and (for the prefix-cache pass) how many leading
    tokens it shares with the previous request of the case."""

    prompt_len: int
    max_tokens: int
    shared_prefix: int = 0


@dataclass(frozen=True)
class ImageCase:
    """A Qwen3.5 multimodal checkpoint (text and vision configs drawn, its processor's pixel range) and images to
    answer: (width, height, kind, pixel seed) each, kind a PNG mode or JPEG (vision_support.image_file)."""

    family: str
    text: dict  # Qwen3_5TextConfig kwargs
    vision: dict  # Qwen3_5VisionConfig kwargs
    min_pixels: int
    max_pixels: int
    images: tuple[tuple[int, int, str, int], ...]

    def summary(self) -> str:
        v, t = self.vision, self.text
        return (f"{self.family} text hidden {t['hidden_size']} layers {t['num_hidden_layers']} vision depth "
                f"{v['depth']} hidden {v['hidden_size']}/{v['num_heads']} heads patch {v['patch_size']} merge "
                f"{v['spatial_merge_size']} table {v['num_position_embeddings']} pixels {self.min_pixels}.."
                f"{self.max_pixels} images " + ", ".join(f"{w}x{h} {k}" for w, h, k, _ in self.images))


@dataclass(frozen=True)
class Case:
    seed: int
    family: str
    config: dict  # kwargs of the family's transformers config class
    fmt: Format
    engine: dict  # EngineConfig settings
    batch: tuple[Request, ...]  # submitted together
    follow_ups: tuple[Request, ...] = field(default=())  # each after the batch, sharing a prefix with it
    image: ImageCase | None = None  # a multimodal case run beside the text one
    fixed_drafts: bool = False  # a speculating case drafts its most every step (the adaptive policy off)

    def summary(self) -> str:
        c = self.config
        gdn = (f" gdn Hk{c['linear_num_key_heads']}/Hv{c['linear_num_value_heads']} "
               f"dk{c['linear_key_head_dim']}/dv{c['linear_value_head_dim']}") if "linear_key_head_dim" in c else ""
        moe = f" experts {c['num_experts']}/top{c['num_experts_per_tok']}" if "num_experts" in c else ""
        return (f"seed {self.seed}: {self.family} {self.fmt.label()} hidden {c['hidden_size']} layers "
                f"{c['num_hidden_layers']} heads {c['num_attention_heads']}/{c['num_key_value_heads']}x"
                f"{c['head_dim']}{gdn}{moe} engine {self.engine}"
                + (f"; and {self.image.summary()}" if self.image else ""))


def draw_case(seed: int) -> Case:
    """The case a seed names (the same on every machine: random.Random is specified). The regression seeds of
    test_fuzz.py name cases through this order of draws: a new dimension draws from its own
    random.Random(f"{seed}:<name>") so that every existing seed keeps its case. Those so far: "kv_dtype" (the KV
    cache's storage; a seed drawn before it ran float32), "image" (a multimodal case some seeds carry beside
    their text case), "speculative" (prompt-lookup drafts verified in the step), "mtp" (a Qwen3.5 safetensors case
    not drawn for prompt lookup gets an MTP head and drafts with it; such a seed ran without one before) and
    "activation" (int8 activations where 4-bit weights stay packed; a seed drawn before it ran float32)."""
    rng = random.Random(seed)
    family = rng.choice(FAMILIES)
    fmt_kind = rng.choice(formats_for(family))
    gguf = fmt_kind == "gguf"
    config = draw_config(rng, family, gguf)
    fmt = draw_format(rng, fmt_kind, config)
    engine = draw_engine(rng, family, fmt)
    engine["kv_dtype"] = random.Random(f"{seed}:kv_dtype").choice(KV_DTYPES)
    speculative = random.Random(f"{seed}:speculative")
    if speculative.random() < SPECULATIVE_RATE:
        engine.update(speculative="ngram", speculative_tokens=speculative.randint(1, 4))
    fixed_drafts = False
    if "speculative" not in engine and family == "qwen3_5_text" and fmt.kind == "safetensors":
        mtp = random.Random(f"{seed}:mtp")
        if mtp.random() < MTP_RATE:
            engine.update(speculative="mtp", speculative_tokens=mtp.randint(1, 4))
            # mostly every draft verified: a random head on a tiny model never pays, so the policy would soon stop
            # drafting and retire the requests (what the rest of the MTP cases run)
            fixed_drafts = mtp.random() < FIXED_DRAFTS_RATE
    engine["activation_dtype"] = "float32"
    if held_quantized(fmt, engine) and family not in MOE_FAMILIES:
        if random.Random(f"{seed}:activation").random() < INT8_RATE:
            engine["activation_dtype"] = "int8"
    batch, follow_ups = draw_requests(rng, engine, GGUF_CONTEXT if gguf else None)
    return Case(seed, family, config, fmt, engine, batch, follow_ups, draw_image_case(seed), fixed_drafts)


def draw_image_case(seed: int) -> ImageCase | None:
    """One seed in IMAGE_CASE_RATE: a Qwen3.5 multimodal checkpoint whose text config is draw_config's (hybrid
    layers, GDN and attention heads, partial rotary as mrope sections) and whose vision config is drawn here: depth,
    heads and their width (a multiple of 4: the 2-D rotary takes a quarter of it per axis), MLP width, patch size,
    merge, a square position table other than the grids it will meet, out width = the text's hidden size. The
    processor's pixel range in units of one merged token (patch x merge)^2, and 1..2 images from
    vision_support.draw_image's law (area a quarter of min to four times max, aspect to 16:1 or one time in eight
    200:1, a PNG mode or JPEG)."""
    import numpy as np  # the image law is vision_support's, on a numpy generator

    rng = random.Random(f"{seed}:image")
    if rng.random() >= IMAGE_CASE_RATE:
        return None
    text = draw_config(rng, "qwen3_5_text")
    text["tie_word_embeddings"] = False  # Qwen3_5Config ties through its own top-level flag
    heads, head_dim = rng.randint(1, 4), rng.choice((8, 16, 32))
    patch, merge = rng.choice((4, 8, 14, 16)), rng.choice((1, 2, 2, 2))
    vision = dict(depth=rng.randint(1, 3), hidden_size=heads * head_dim, num_heads=heads,
                  intermediate_size=rng.choice((32, 64, 96)), out_hidden_size=text["hidden_size"], patch_size=patch,
                  spatial_merge_size=merge, num_position_embeddings=rng.choice((4, 8, 12, 16)) ** 2)
    token_pixels = (patch * merge) ** 2
    max_tokens = rng.randint(4, 96)
    min_pixels, max_pixels = token_pixels * rng.randint(1, min(4, max_tokens)), token_pixels * max_tokens
    from tests.vision_support import draw_image

    images = []
    for _ in range(rng.randint(1, 2)):
        width, height, kind = draw_image(np.random.default_rng(rng.getrandbits(32)), min_pixels, max_pixels)
        images.append((width, height, kind, rng.getrandbits(30)))
    return ImageCase(IMAGE_FAMILIES[0], text, vision, min_pixels, max_pixels, tuple(images))


def formats_for(family: str) -> tuple[str, ...]:
    # GGUF of the hybrids needs llama.cpp's converter (not a dependency); write_gguf serves llama and qwen3.
    kinds = ("safetensors", "safetensors", "compressed_tensors", "gptq", "awq")
    return kinds + ("gguf",) if family in ("llama", "qwen3") else kinds


def draw_config(rng: random.Random, family: str, gguf: bool = False) -> dict:
    """Transformers config kwargs for `family`; with gguf, the shape write_gguf's metadata describes (intermediate
    2 x hidden, head_dim hidden / heads, context 128, its vocabulary and rotary base)."""
    kv_heads = rng.randint(1, 4)
    heads = kv_heads * rng.choice((1, 1, 2, 3, 4, 5, 8))  # GQA ratio 1..8, odd head counts included
    head_dim = rng.choice(ATTENTION_HEAD_DIMS)
    hidden = rng.choice((32, 64, 96, 128, 160, 256))
    if family == "llama":  # LlamaConfig requires heads to divide the hidden size (head_dim given or not)
        step = math.lcm(heads, 16)
        hidden = step * rng.randint(1, max(1, 256 // step))
    if gguf:  # every row a multiple of 32 (the Q4 / Q8 block); head_dim from hidden / heads
        heads = kv_heads * rng.choice((1, 2))
        head_dim = rng.choice((32, 64))
        hidden = heads * head_dim
    config = dict(
        vocab_size=GGUF_VOCAB if gguf else VOCAB, hidden_size=hidden, num_hidden_layers=rng.randint(1, 4),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=2 * hidden if gguf else rng.choice((32, 64, 96, 128, 192, 256)),
        tie_word_embeddings=rng.random() < 0.4, initializer_range=0.1,
        max_position_embeddings=GGUF_CONTEXT if gguf else 4096, rms_norm_eps=1e-6)
    if gguf:
        config["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0)
    elif family in ("llama", "qwen3"):
        config["rope_parameters"] = dict(rope_type="default", rope_theta=rng.choice((10000.0, 1e6)))
        config["attention_bias"] = rng.random() < 0.15  # q, k, v and o_proj biases
    if family in GDN_FAMILIES:
        config.update(draw_gdn(rng, config["num_hidden_layers"], head_dim, family))
    if family in MOE_FAMILIES:
        config.update(draw_moe(rng, config["num_hidden_layers"], family))
    if family == "qwen3_5_moe_text":  # every layer's MLP is the MoE: no dense intermediate size
        del config["intermediate_size"]
    return config


def draw_gdn(rng: random.Random, layers: int, head_dim: int, family: str) -> dict:
    """GDN heads (Hv a multiple of Hk, ratio 1..4), key and value head dims drawn apart, a layer-type list, and
    partial rotary (Qwen3.5 as mrope sections over the rotary half, which text positions reduce to plain rope)."""
    key_heads = rng.randint(1, 4)
    gdn = dict(linear_num_key_heads=key_heads, linear_num_value_heads=key_heads * rng.randint(1, 4),
               linear_key_head_dim=rng.choice(GDN_KEY_HEAD_DIMS),
               linear_value_head_dim=rng.choice(GDN_VALUE_HEAD_DIMS),
               linear_conv_kernel_dim=rng.choice((2, 3, 4)),
               layer_types=[rng.choice(("linear_attention", "full_attention")) for _ in range(layers)])
    factor = rng.choice(tuple(f for f in (0.25, 0.5, 1.0) if (head_dim * f) % 4 == 0))
    rope = dict(rope_type="default", rope_theta=rng.choice((10000.0, 1e6)), partial_rotary_factor=factor)
    if family != "qwen3_next":
        half = int(head_dim * factor) // 2
        rope.update(mrope_section=[half - 2 * (half // 4), half // 4, half // 4], mrope_interleaved=True)
    gdn["rope_parameters"] = rope
    return gdn


def draw_moe(rng: random.Random, layers: int, family: str) -> dict:
    experts = rng.randint(2, 8)
    moe = dict(num_experts=experts, num_experts_per_tok=rng.randint(1, min(4, experts)),
               moe_intermediate_size=rng.choice((16, 32, 64)),
               shared_expert_intermediate_size=rng.choice((16, 32, 48)))
    if family == "qwen3_next":
        moe.update(decoder_sparse_step=rng.choice((1, 2)), norm_topk_prob=rng.random() < 0.5,
                   mlp_only_layers=sorted(rng.sample(range(layers), rng.randint(0, layers // 2))))
    return moe


def linear_in_features(config: dict) -> list[int]:
    """The input widths of the decoder's linears: what a quantization group must divide."""
    widths = [config["hidden_size"], config["num_attention_heads"] * config["head_dim"]]
    if "linear_value_head_dim" in config:
        widths.append(config["linear_num_value_heads"] * config["linear_value_head_dim"])
    if "num_experts" in config:
        widths.append(config["shared_expert_intermediate_size"])
    if "num_experts" not in config or config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) > 1:
        widths.append(config["intermediate_size"])
    return widths


def draw_format(rng: random.Random, kind: str, config: dict) -> Format:
    if kind == "safetensors":
        return Format(kind, dtype=rng.choice(("float32", "bfloat16")))
    if kind == "gguf":
        return Format(kind, gguf_types=tuple(rng.choice(GGUF_TYPES) for _ in range(64)))
    widths = linear_in_features(config)
    groups = [g for g in (32, 64, 128) if all(w % g == 0 for w in widths)]
    if kind == "compressed_tensors":
        bits = rng.choice((4, 8))
        return Format(kind, bits=bits, group=rng.choice(groups + [None]), symmetric=rng.random() < 0.5,
                      packed=bits == 4 or rng.random() < 0.5, int8_embedding=rng.random() < 0.4)
    return Format(kind, group=rng.choice(groups or [None]), symmetric=rng.random() < 0.5,
                  act_order=kind == "gptq" and rng.random() < 0.5)


def draw_engine(rng: random.Random, family: str, fmt: Format) -> dict:
    """Small pages, chunks and checkpoint intervals, so that short prompts cross each of them."""
    page = rng.choice((4, 8, 16))
    settings = dict(page_size=page, prefill_chunk_tokens=rng.choice((7, 8, 16, 24, 32)),
                    prefix_cache=rng.random() < 0.6, max_running_requests=rng.choice((2, 4, 8)))
    if family in GDN_FAMILIES:
        settings.update(checkpoint_interval_tokens=page * rng.choice((1, 2, 3)), checkpoint_slots=rng.choice((2, 8)))
    if fmt.kind in ("compressed_tensors", "gptq", "awq", "gguf"):
        settings["dequantize_weights"] = rng.random() < 0.5  # packed: the int4 kernels; else float32 matrices
    return settings


def held_quantized(fmt: Format, engine: dict) -> bool:
    """Whether the engine keeps 4-bit weights packed or 8-bit ones (compressed-tensors INT8, a GGUF's Q8_0) int8
    (the layers --activation-dtype int8 applies to)."""
    if engine.get("dequantize_weights", True):
        return False
    if fmt.kind == "compressed_tensors":
        return True  # 4-bit packed, 8-bit held int8
    if fmt.kind == "gguf":
        return any(t in ("Q4_0", "Q4_1", "Q8_0") for t in fmt.gguf_types)
    return fmt.kind in ("gptq", "awq")


def draw_requests(rng: random.Random, engine: dict, context: int | None) -> tuple[tuple, tuple]:
    """A batch of 1..3 prompts and, with the prefix cache, follow-ups that resend a prefix of a batch prompt.
    Lengths sit on and beside the chunk, page and checkpoint boundaries."""
    marks = [engine["prefill_chunk_tokens"], engine["page_size"], engine.get("checkpoint_interval_tokens", 0)]
    limit = (context or 200) - 8

    def length() -> int:
        base = rng.choice(marks) * rng.randint(1, 3) + rng.choice((-1, 0, 1, rng.randint(2, 9)))
        return max(1, min(limit, base if rng.random() < 0.8 else rng.randint(1, limit)))

    batch = tuple(Request(length(), rng.randint(1, 4)) for _ in range(rng.randint(1, 3)))
    follow_ups = ()
    if engine["prefix_cache"]:
        follow_ups = tuple(Request(min(limit, shared + rng.randint(1, 12)), rng.randint(1, 4), shared_prefix=shared)
                           for shared in (rng.randint(1, r.prompt_len) for r in batch[:rng.randint(1, len(batch))]))
    return batch, follow_ups
