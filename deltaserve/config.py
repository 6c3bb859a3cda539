"""EngineConfig: every engine and server setting, one frozen dataclass, parsed once from the command line.

Device-dependent defaults (memory fraction, headroom, dtypes, prefill chunk) are left as None / "auto" here and
filled in by `EngineConfig.for_device(kind)`, so one config describes the same intent on a CPU and on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass

KiB = 1024
MiB = 1024**2
GiB = 1024**3

DEVICE_KINDS = ("cpu", "cuda")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
}
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
SIZE_FLAGS = {"headroom": "--headroom", "device_memory": "--device-memory", "max_body_bytes": "--max-body-bytes",
              "max_image_bytes": "--max-image-bytes",
              "responses_store_bytes": "--responses-store-bytes"}
STATE_DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "portable", "paged")
PREFILL_DTYPES = ("float32", "bfloat16")  # the packed 4-bit GEMM's arithmetic (kernels/int4_cpu.py)
ACTIVATION_DTYPES = ("float32", "int8")  # what packed 4-bit and int8 weights multiply on CPU (kernels/int4_int8.py)

DEFAULT_MAX_NEW_TOKENS_CAP = 16384
DEFAULT_MAX_RUNNING_REQUESTS = 16  # when not given and the device holds it (budget/fit.py halves it where not)
# Host RAM is shared with the OS, the page cache of the checkpoint, the tokenizer and the HTTP server.
CPU_MEM_FRACTION = 0.5
# Stock engines use 0.9 on a dedicated card; incident 4 shows why the rest must stay free.
GPU_MEM_FRACTION = 0.9
GPU_HEADROOM_BYTES = 512 * MiB  # a desktop compositor / browser on the same GPU (incident 2: ~0.7 GB)
CPU_PREFILL_CHUNK_TOKENS = 512  # keeps one step's activations small; the CPU is compute-bound well before 512
GPU_PREFILL_CHUNK_TOKENS = 2048

API_KEY_ENV = "DELTASERVE_API_KEY"

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "kb": 1000,
    "m": MiB, "mib": MiB, "mb": 1000**2,
    "g": GiB, "gib": GiB, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*(-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A setting is invalid; the message is one line naming the setting and its limit."""


def cpu_kv_dtype(compute_dtype: str) -> str:
    """The CPU KV cache's default: float16 storage under float32 arithmetic (llama.cpp's default cache is f16 too).
    Twice the tokens per GiB, and decode reads half the bytes (64-request SmolLM2 workload: 144 vs 122 output tok/s,
    bench/throughput.py, session 7); greedy tokens equal the float32 cache's in the tests, log-probabilities within
    0.002. A 16-bit compute dtype keeps its own."""
    return "float16" if compute_dtype == "float32" else compute_dtype


def torch_int4_layout(device: str, dtype: str) -> bool:
    """Whether a model's 4-bit matrices are held in torch's int4 layout and multiplied by its kernel
    (kernels/int4_torch.py): on CUDA, computing in bfloat16. The loader and the ledger both ask this."""
    return str(device).split(":")[0] == "cuda" and str(dtype).removeprefix("torch.") == "bfloat16"


def int8_activation_panels(device: str, activation_dtype: str) -> bool:
    """Whether the packed 4-bit and 8-bit linears the int8 dot-product kernel takes are swapped into its panels
    (models/int8_activations.py; GGUF's K-quants held there as compactly as the file where --compact-weights): on
    CPU, with --activation-dtype int8. The engine and the ledger both ask this."""
    return str(device).split(":")[0] == "cpu" and activation_dtype == "int8"


def parse_bytes(text: str | int) -> int:
    """'24GiB', '512MiB', '1.5GB', '8G' (binary), '4096' -> bytes. KB/MB/GB are decimal, K/M/G and KiB.. binary.

    A leading minus is read (and left to the caller's range check, which names the setting)."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"cannot read {text!r} as a size: use e.g. 24GiB, 512MiB, 1.5GB or a number of bytes")
    return int(round(float(match.group(1)) * _SIZE_UNITS[unit]))


def normalize_dtype(name: str, allowed: tuple[str, ...], setting: str) -> str:
    """Canonical dtype name ('bf16' -> 'bfloat16'); 'auto' passes through."""
    if name == "auto":
        return name
    canonical = DTYPE_ALIASES.get(name.lower(), name.lower())
    if canonical not in allowed:
        raise ConfigError(f"{setting} {name!r} is not supported: choose auto, {', '.join(allowed)}")
    return canonical


# The parsers of deltaserve.text (named here: config is a leaf and imports nothing of ours).
TOOL_CALL_PARSERS = ("auto", "none", "qwen3_coder", "hermes", "llama3_json")
REASONING_PARSERS = ("auto", "none", "think")
SPECULATIVE_METHODS = ("auto", "off", "ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 8  # drafts a step verifies per request; each costs a GDN state (engine/speculative.py)


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of one engine (and its server). None / "auto" means: decided by the device kind."""

    model: str | None = None  # None: the built-in default model
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # compute dtype; auto: float32 on CPU, bfloat16 on CUDA
    page_size: int = 16  # KV tokens per page
    mem_fraction: float | None = None  # of the device TOTAL; None: 0.9 GPU, 0.5 CPU
    device_memory: int | None = None  # bytes; overrides what the device reports (plans for another card)
    headroom: int | None = None  # bytes kept for other processes; None: 0 CPU, 512 MiB GPU
    max_total_tokens: int | None = None  # None: the KV pool is what remains
    context_length: int | None = None  # None: the model's max_position_embeddings, capped at the pool
    max_running_requests: int | None = None  # None: 16, fewer where the device cannot hold them (budget/fit.py)
    prefill_chunk_tokens: int | None = None  # None: 512 CPU, 2048 GPU
    kv_dtype: str = "auto"  # auto: float16 on CPU (float32 arithmetic), the compute dtype on CUDA
    state_dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    max_new_tokens_cap: int | None = None  # None: 16384, lowered to the context length
    default_max_tokens: int | None = None  # None: what remains of the context, capped by max_new_tokens_cap
    max_queue: int = 64  # waiting requests; beyond it the server answers 429
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # also from --api-key-file or DELTASERVE_API_KEY (`ps` shows a command line)
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides localhost/127.0.0.1/[::1] on a loopback bind
    allowed_origins: tuple[str, ...] = ()  # CORS origins; none: no CORS headers, browsers cannot read answers
    header_timeout_s: float = 10.0  # a connection must send a request's headers within this, else 408 and close
    max_connections: int = 512  # open connections; beyond it a new one gets 503 and is closed
    shutdown_timeout_s: float = 30.0  # on SIGTERM, running requests finish within this; 0: cut them at once
    served_model_name: str | None = None
    max_body_bytes: int = 8 * MiB  # a 100K-token prompt is ~0.5 MB of JSON; escaping can multiply it
    responses_store_bytes: int = 64 * MiB  # Responses API store (previous_response_id), as JSON; 0: none kept
    seed: int = 0
    attention_backend: str = "auto"  # auto = paged: decode in place, prefill tiled (CPU: kernels built at start)
    dequantize_weights: bool | None = None  # None: packed (on CPU the float32 kernel of kernels/int4.py)
    prefill_dtype: str = "float32"  # bfloat16: packed 4-bit GEMMs (prefill) on bf16 dot products, opt-in
    activation_dtype: str = "int8"  # packed 4-bit linears on int8 activations and integer dot products (CPU)
    tool_call_parser: str = "auto"  # auto: picked from the chat template's own tool-call format
    reasoning_parser: str = "auto"  # auto: "think" when the chat template writes <think> blocks
    chat_template: str | None = None  # a jinja file used instead of the model's own chat template
    prefix_cache: bool = True  # reuse the KV pages (and GDN checkpoints) of prompts seen before
    # GGUF K-quants held in the int8 kernel's panels as their file holds them (-28% weight memory on a Q4_K_M, but
    # decode ~10% slower here: kernels/int4_int8.py); None: fitted, on only where the model needs the memory
    compact_weights: bool | None = None
    checkpoint_slots: int = 8  # GDN state checkpoints the prefix cache keeps (hybrid models; its own ledger line)
    checkpoint_interval_tokens: int = 2048  # a GDN checkpoint every this many prompt tokens
    # auto (mtp where the checkpoint has a head that leaves the KV pool 3/4 of its tokens, on CPU for now, else off:
    # budget/advice.py auto_speculation) | off | ngram (prompt lookup) | mtp (the checkpoint's own MTP head)
    speculative: str = "auto"
    speculative_tokens: int = 3  # draft tokens a decode step verifies at most, per request
    language_model_only: bool = False  # skip a multimodal checkpoint's vision tower: its memory becomes context
    max_images_per_request: int = 8
    max_image_bytes: int = 5 * MiB  # of one encoded image (Anthropic's limit too)
    max_image_pixels: int = 1024 * 1024  # an image is resized to at most this area: 1024 tokens at 32 x 32 per token
    allowed_local_media_path: str | None = None  # image_url file:// paths are read only under this folder

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype, COMPUTE_DTYPES, "--dtype"))
        object.__setattr__(self, "kv_dtype", normalize_dtype(self.kv_dtype, tuple(DTYPE_BYTES), "--kv-dtype"))
        object.__setattr__(self, "state_dtype", normalize_dtype(self.state_dtype, STATE_DTYPES, "--state-dtype"))
        _validate(self)

    def for_device(self, kind: str) -> EngineConfig:
        """This config with every device-dependent default filled in for 'cpu' or 'cuda'."""
        if kind not in DEVICE_KINDS:
            raise ConfigError(f"device kind {kind!r} is not supported: choose {' or '.join(DEVICE_KINDS)}")
        gpu = kind == "cuda"
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if gpu else "float32")
        return dataclasses.replace(
            self,
            device=self.device if self.device.startswith(kind) else kind,
            dtype=dtype,
            mem_fraction=self.mem_fraction or (GPU_MEM_FRACTION if gpu else CPU_MEM_FRACTION),
            max_running_requests=self.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
            headroom=self.headroom if self.headroom is not None else (GPU_HEADROOM_BYTES if gpu else 0),
            prefill_chunk_tokens=self.prefill_chunk_tokens
            or (GPU_PREFILL_CHUNK_TOKENS if gpu else CPU_PREFILL_CHUNK_TOKENS),
            kv_dtype=self.kv_dtype if self.kv_dtype != "auto" else cpu_kv_dtype(dtype) if not gpu else dtype,
            state_dtype=self.state_dtype if self.state_dtype != "auto" else ("bfloat16" if gpu else "float32"),
            attention_backend=self.attention_backend if self.attention_backend != "auto" else "paged",
            dequantize_weights=bool(self.dequantize_weights),
            compact_weights=bool(self.compact_weights),
        )

    def device_kind(self) -> str:
        """'cpu' or 'cuda' for this config's device ('auto' asks torch whether CUDA is present)."""
        if self.device == "auto":
            import torch  # only here: config stays importable without touching a device

            return "cuda" if torch.cuda.is_available() else "cpu"
        return "cuda" if self.device.startswith("cuda") else "cpu"

    def to_dict(self) -> dict:
        """All settings as plain JSON values (api_key redacted)."""
        values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        if values["api_key"] is not None:
            values["api_key"] = "***"
        return values

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """Build from an argparse namespace filled by `add_engine_arguments`; bad values raise ConfigError."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
        device = values.get("device")
        if device is not None and device not in ("auto", "cpu") and not device.startswith("cuda"):
            # `--device 24GiB` plans for a GPU of that size.
            try:
                values["device_memory"] = parse_bytes(device)
            except ConfigError:
                raise ConfigError(f"--device {device!r} is not supported: choose auto, cpu, cuda, cuda:N "
                                  f"or a size such as 24GiB") from None
            values["device"] = "cuda"
        values["api_key"] = _api_key(values.get("api_key"), getattr(args, "api_key_file", None))
        for name, flag in SIZE_FLAGS.items():
            if isinstance(values.get(name), str):
                try:
                    values[name] = parse_bytes(values[name])
                except ConfigError as e:
                    raise ConfigError(f"{flag}: {e}") from None
        return cls(**values)


def _api_key(given: str | None, key_file: str | None) -> str | None:
    """The key from --api-key, else --api-key-file (its first line), else $DELTASERVE_API_KEY, else None."""
    if given is not None and key_file is not None:
        raise ConfigError("--api-key and --api-key-file are both given: use one")
    if key_file is not None:
        try:
            with open(key_file) as f:
                given = f.readline().strip()
        except OSError as e:
            raise ConfigError(f"--api-key-file {key_file}: cannot read it: {e.strerror or e}") from None
        if not given:
            raise ConfigError(f"--api-key-file {key_file}: the first line is empty: put the key there")
    elif given is None:
        given = os.environ.get(API_KEY_ENV) or None
    return given


def _validate(c: EngineConfig) -> None:
    """One clear line per bad setting: what was given and the limit."""
    if c.mem_fraction is not None and not 0 < c.mem_fraction <= 1:
        raise ConfigError(f"--mem-fraction {c.mem_fraction} is out of range: it must be in (0, 1]")
    if c.headroom is not None and c.headroom < 0:
        raise ConfigError(f"--headroom {c.headroom} is negative: it must be >= 0 bytes")
    positive = {
        "--page-size": c.page_size, "--max-running-requests": c.max_running_requests,
        "--max-queue": c.max_queue, "--max-body-bytes": c.max_body_bytes,
        "--max-total-tokens": c.max_total_tokens, "--context-length": c.context_length,
        "--prefill-chunk-tokens": c.prefill_chunk_tokens, "--device-memory": c.device_memory,
        "--max-new-tokens-cap": c.max_new_tokens_cap, "--default-max-tokens": c.default_max_tokens,
        "--header-timeout-s": c.header_timeout_s, "--max-connections": c.max_connections,
        "--checkpoint-slots": c.checkpoint_slots, "--checkpoint-interval-tokens": c.checkpoint_interval_tokens,
        "--max-image-bytes": c.max_image_bytes, "--max-image-pixels": c.max_image_pixels,
    }
    if c.max_images_per_request < 0:
        raise ConfigError(f"--max-images-per-request {c.max_images_per_request} must be >= 0 (0: no images)")
    for flag, value in positive.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} {value} must be a positive number")
    if c.shutdown_timeout_s < 0:
        raise ConfigError(f"--shutdown-timeout {c.shutdown_timeout_s} is negative: it must be >= 0 seconds "
                          f"(0 ends running requests at once)")
    if c.max_total_tokens is not None and 0 < c.max_total_tokens < c.page_size:
        raise ConfigError(f"--max-total-tokens {c.max_total_tokens} is less than one KV page of --page-size "
                          f"{c.page_size} tokens: the pool holds whole pages")
    if c.responses_store_bytes < 0:
        raise ConfigError(f"--responses-store-bytes {c.responses_store_bytes} is negative: it must be >= 0 bytes "
                          f"(0 keeps no responses)")
    if c.max_new_tokens_cap is not None and c.context_length is not None and c.max_new_tokens_cap > c.context_length:
        raise ConfigError(f"--max-new-tokens-cap {c.max_new_tokens_cap} exceeds --context-length {c.context_length}: "
                          f"the cap must be at most the context length")
    cap = c.max_new_tokens_cap or DEFAULT_MAX_NEW_TOKENS_CAP
    if c.default_max_tokens is not None and c.default_max_tokens > cap:
        raise ConfigError(f"--default-max-tokens {c.default_max_tokens} exceeds the max-new-tokens cap {cap}: "
                          f"lower it or raise --max-new-tokens-cap")
    if not 0 <= c.port <= 65535:
        raise ConfigError(f"--port {c.port} is out of range: it must be in 0..65535")
    if c.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"--attention-backend {c.attention_backend!r} is not supported: "
                          f"choose {', '.join(ATTENTION_BACKENDS)}")
    if c.prefill_dtype not in PREFILL_DTYPES:
        raise ConfigError(f"--prefill-dtype {c.prefill_dtype!r} is not supported: choose {', '.join(PREFILL_DTYPES)}")
    if c.activation_dtype not in ACTIVATION_DTYPES:
        raise ConfigError(f"--activation-dtype {c.activation_dtype!r} is not supported: "
                          f"choose {', '.join(ACTIVATION_DTYPES)}")
    if c.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(f"--tool-call-parser {c.tool_call_parser!r} is not supported: "
                          f"choose {', '.join(TOOL_CALL_PARSERS)}")
    if c.speculative not in SPECULATIVE_METHODS:
        raise ConfigError(f"--speculative {c.speculative!r} is not supported: choose {', '.join(SPECULATIVE_METHODS)}")
    if not 1 <= c.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"--speculative-tokens {c.speculative_tokens} is out of range: it must be in "
                          f"1..{MAX_SPECULATIVE_TOKENS}")
    if c.reasoning_parser not in REASONING_PARSERS:
        raise ConfigError(f"--reasoning-parser {c.reasoning_parser!r} is not supported: "
                          f"choose {', '.join(REASONING_PARSERS)}")
    if c.device != "auto" and c.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", c.device):
        raise ConfigError(f"--device {c.device!r} is not supported: "
                          f"choose auto, cpu, cuda, cuda:N or a size like 24GiB")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every EngineConfig flag; defaults stay None so `from_args` knows what was given."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", help="checkpoint folder, .gguf file or config.json (default: built-in SmolLM2)")
    g.add_argument("--device", help="auto, cpu, cuda, cuda:N, or a size such as 24GiB to plan for a GPU of it")
    g.add_argument("--device-memory", help="the device's total memory to plan with, e.g. 24GiB "
                   "(default: what the device reports: MemTotal on CPU, the card's total on CUDA)")
    g.add_argument("--dtype", help="compute dtype: auto (float32 CPU, bfloat16 CUDA), float32, bfloat16, float16 "
                   "(on CPU the native kernels are float32 only: others go op by op, decode ~3x slower)")
    g.add_argument("--page-size", type=int, help="KV tokens per page (16)")
    g.add_argument("--mem-fraction", type=float,
                   help="fraction of the device TOTAL memory to budget (0.9 GPU, 0.5 CPU; on CPU raised up to 0.9 "
                   "where the model does not fit at 0.5)")
    g.add_argument("--headroom", help="bytes kept free for other processes, e.g. 1.5GiB (512MiB GPU, 0 CPU)")
    g.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens, rounded down to whole "
                   "pages (default: what remains)")
    g.add_argument("--context-length", type=int, help="longest request, prompt + completion (default: the model's, "
                   "shortened where the device cannot hold one request of it)")
    g.add_argument("--max-running-requests", type=int, help="requests decoded at once = GDN state slots "
                   "(16, halved where the device cannot hold them)")
    g.add_argument("--prefill-chunk-tokens", type=int, help="prompt tokens read per step (512 CPU, 2048 GPU)")
    g.add_argument("--kv-dtype", help="KV cache dtype: auto (float16 on CPU, the compute dtype on GPU), float32, "
                   "bfloat16, float16, fp8; 16-bit halves the cache (storage only: on CPU the arithmetic stays "
                   "float32; float32 here is exact against transformers)")
    g.add_argument("--state-dtype", help="GDN state dtype: auto (float32 CPU, bfloat16 GPU), float32, bfloat16")
    g.add_argument("--max-new-tokens-cap", type=int, help=f"most new tokens one request may reserve "
                   f"({DEFAULT_MAX_NEW_TOKENS_CAP}, at most the context)")
    g.add_argument("--default-max-tokens", type=int, help="new tokens reserved when a request sets no max_tokens "
                   "(default: the rest of the context, capped by --max-new-tokens-cap)")
    g.add_argument("--max-queue", type=int, help="waiting requests before the server answers 429 (64)")
    g.add_argument("--host", help="listen address (127.0.0.1)")
    g.add_argument("--port", type=int, help="listen port (8000)")
    g.add_argument("--served-model-name", help="the model name the API reports and accepts "
                   "(default: the checkpoint's name)")
    g.add_argument("--max-body-bytes", help="largest request body; a larger one gets 413 (8MiB)")
    g.add_argument("--responses-store-bytes", help="memory for stored Responses API responses (previous_response_id, "
                   "GET /v1/responses/{id}), oldest evicted first; 0 keeps none (64MiB)")
    g.add_argument("--seed", type=int, help="seed of the engine's seed stream: a request that names no seed "
                   "draws one from it, so runs repeat from start to start (0)")
    g.add_argument("--attention-backend", help="auto (= paged: decode reads KV pages in place and prefill runs a "
                   "tiled kernel; on CPU C++ kernels built at start), portable (gather + torch's SDPA for both)")
    g.add_argument("--prefill-dtype", help="float32 (default): packed 4-bit weights multiply prefill rows in float32, "
                   "equal to the dequantized model to float32 rounding; bfloat16: rows and weights rounded to "
                   "bfloat16 and multiplied by AVX512-BF16 dot products (~1.7x the GEMM rate; CPUs with AVX512-BF16, "
                   "else float32 and a log line). Steps of more than 16 rows only: decode stays float32")
    g.add_argument("--activation-dtype", help="int8 (default): on CPU, packed 4-bit weights (affine or IQ4's levels) "
                   "and 8-bit ones (Q8_0, INT8) multiply their input rows quantized to int8 per block of 32 columns "
                   "(one float32 scale each, as llama.cpp's Q8_0 / Q8_1) by "
                   "integer dot products (AVX-512 VNNI, else AVX2), decode and prefill rows alike: ~2x the float32 "
                   "rate, perplexity within 0.3%% of float32, but a greedy token at a near-tie may differ with the "
                   "batch a request shares a step with. float32: the exact path, equal to the dequantized model to "
                   "float32 rounding (use it for output that does not depend on batching). A layer the int8 kernel "
                   "does not take (output rows not a multiple of 16, a level table of non-integers) keeps float32, "
                   "said in a log line")
    g.add_argument("--dequantize-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="hold 4-bit weights (and 8-bit ones) dequantized in the compute dtype (default: "
                        "packed, 8-bit as int8 on CPU; on CPU multiplied by "
                        "int8 activations, or under --activation-dtype float32 in float32 with the dequantized "
                        "model's result to float32 rounding)")
    g.add_argument("--tool-call-parser", help=f"how tool calls are read from the output: "
                   f"{', '.join(TOOL_CALL_PARSERS)} (auto: from the chat template)")
    g.add_argument("--reasoning-parser", help=f"{', '.join(REASONING_PARSERS)}: split <think> reasoning from "
                   f"the answer (auto: when the chat template writes <think>)")
    g.add_argument("--chat-template", help="a jinja chat template file used instead of the model's own")
    g.add_argument("--language-model-only", action=argparse.BooleanOptionalAction, default=None,
                   help="skip a multimodal checkpoint's vision tower (no image input): its memory becomes context")
    g.add_argument("--max-images-per-request", type=int, help="images one request may carry (8; 0: none)")
    g.add_argument("--max-image-bytes", help="largest encoded image, e.g. 5MiB (5MiB)")
    g.add_argument("--max-image-pixels", type=int, help="images are resized to at most this many pixels "
                   "(1048576 = 1024 tokens per image)")
    g.add_argument("--allowed-local-media-path", help="let image_url name file:// paths under this folder "
                   "(default: none; http(s) URLs are never fetched)")
    g.add_argument("--compact-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="hold a GGUF's K-quant tensors (Q4_K, Q5_K, Q6_K, IQ4_XS) as compactly as the file on CPU's "
                        "int8 path (about 28%% less weight memory on a Q4_K_M, decode about 10%% slower); default: "
                        "on only where the model does not fit otherwise (`plan` says so)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None,
                   help="compute every prompt from its first token (no reuse of earlier prompts' KV and state)")
    g.add_argument("--checkpoint-slots", type=int, help="GDN state checkpoints the prefix cache keeps on a "
                   "hybrid model (8); each costs what `plan` shows in KV tokens")
    g.add_argument("--checkpoint-interval-tokens", type=int,
                   help="store a GDN checkpoint every this many prompt tokens (2048)")
    g.add_argument("--speculative", choices=SPECULATIVE_METHODS, help="speculative decoding: auto (default: mtp "
                   "where the checkpoint has a multi-token-prediction head and the KV pool keeps 3/4 of its tokens "
                   "with it, on CPU for now, else off; `plan` says which, and the price), off, ngram (prompt lookup: "
                   "draft tokens copied from where the request's last tokens occurred earlier in its prompt or "
                   "output, verified as extra rows of the same step; greedy output is unchanged, sampled output "
                   "keeps its distribution), mtp (drafts from the checkpoint's multi-token-prediction head, mtp.*, "
                   "loaded with the model; its attention layer's KV is one more layer of the KV pool; refused for a "
                   "checkpoint without one). A request drafts only as many tokens as its acceptance pays for")
    g.add_argument("--speculative-tokens", type=int, help=f"draft tokens one decode step verifies at most per "
                   f"request, 1..{MAX_SPECULATIVE_TOKENS} (3); on a hybrid model each costs one GDN state per "
                   f"running request (the ledger's speculative_states line). A request whose drafts are rarely "
                   f"accepted drafts fewer")
    _add_http_arguments(parser)


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """Who may talk to the server, and how: key, hosts, origins, connection limits, the drain at shutdown."""
    g = parser.add_argument_group("access")
    g.add_argument("--api-key", help=f"require this key on every route but /health (visible in `ps`: prefer "
                   f"--api-key-file or ${API_KEY_ENV})")
    g.add_argument("--api-key-file", help="read the key from the first line of this file")
    g.add_argument("--allowed-hosts", type=_names, help="comma-separated Host names accepted besides localhost, "
                   "127.0.0.1 and [::1] when bound to a loopback address (DNS-rebinding guard)")
    g.add_argument("--allowed-origins", type=_names, help="comma-separated browser origins allowed by CORS, e.g. "
                   "http://localhost:3000 (default: none, no CORS)")
    g.add_argument("--header-timeout-s", type=float, help="seconds a connection has to send a request's headers "
                   "before it gets 408 and is closed (10)")
    g.add_argument("--max-connections", type=int, help="open connections; a new one beyond it gets 503 and is "
                   "closed (512)")
    g.add_argument("--shutdown-timeout", "--shutdown-timeout-s", dest="shutdown_timeout_s", type=float,
                   help="on SIGTERM or Ctrl-C, seconds running requests have to finish while new ones get 503; then "
                        "open streams end with an error event and [DONE] (30; 0: at once)")


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def device_memory_bytes(kind: str) -> tuple[int, int]:
    """(total, free) bytes of the device: host RAM for 'cpu' (MemTotal, MemAvailable), the GPU for 'cuda'."""
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device here; pass --device 24GiB to plan for a GPU of that size")
        free, total = torch.cuda.mem_get_info()
        return total, free
    info = {}
    with open("/proc/meminfo") as f:
        for row in f:
            name, value = row.split(":", 1)
            info[name] = int(value.split()[0]) * KiB
    return info["MemTotal"], info.get("MemAvailable", info["MemFree"])
