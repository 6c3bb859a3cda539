"""The one door from the server into the engine: what the server may read of an engine, the messages it hands over,
and the checks that are pure arithmetic on a request.

`Engine.info` is an EngineInfo: the engine described once it has loaded (names, context length, vocabulary, image
marker and limits, the ledger and the admission policy's numbers), read-only. The engine owns its thread and its
state: the server never calls into the scheduler or the pools. It hands the engine messages through one queue
(`Work`: one API request's prompts × n choices; `Abort`; `Query`: stats or a cache flush) and each answer comes back
by one route: a Work's future holds every choice's RequestStream, or `Refused` (engine/errors.py: the HTTP status,
the request field at fault and a message naming what was wrong and the limit), and a stream carries its request's
outputs. `check` runs on the caller's thread before a Work is queued: the number of choices and logit_bias against
the vocabulary. Admission (engine/scheduler.py + engine/admission.py) runs on the engine's thread; a refusal part-way
through a Work leaves nothing running.

`prepare_images` reads and preprocesses a request's images before its prompt is templated (blocking: the server
runs it in a worker thread), refusing a request over the image limits before any image is read.

Besides these the server uses an engine's tokenizer (text/'s Tokenizer: encode, decode, chat templates), `abort`,
`stats`, `flush_cache`, `start` and `shutdown`, and nothing else: tests/test_architecture.py holds it to that.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from deltaserve.budget import Budget
from deltaserve.engine.admission import AdmissionPolicy
from deltaserve.engine.errors import Refused
from deltaserve.engine.request import SamplingParams
from deltaserve.images import ImageError, ImageLimits, ImageSource, PreparedImage, PreprocessorSettings, preprocess, \
    read_source

MAX_CHOICES = 16  # prompts × n per API request: each choice is one engine request


@dataclass(frozen=True)
class EngineInfo:
    """What the server may read of a loaded engine."""

    model_name: str  # the engine's own name for its model (--served-model-name, else the checkpoint's)
    model_path: str
    model_type: str | None  # config.json's, for routers that ask
    architectures: tuple[str, ...]
    context_length: int  # the longest prompt + completion, in tokens
    vocab_size: int  # the width of the logits: the token ids logit_bias may name
    eos_token_ids: frozenset[int]
    prefix_cache: bool  # on: a chat's message boundaries are worth computing (checkpoints are kept there)
    max_prefill_tokens: int  # prompt tokens per step (--prefill-chunk-tokens)
    budget: Budget  # the ledger the pools were allocated by
    accepts_images: bool
    images_refusal: str  # why it takes none, where it does not
    image_marker: str  # the text of the chat template's image placeholder ("" without images)
    image_limits: ImageLimits
    image_settings: PreprocessorSettings | None  # the checkpoint's preprocessing (None without a vision tower)
    admission: AdmissionPolicy  # the ledger's numbers admission decides by: pure arithmetic, read on any thread


@dataclass(frozen=True)
class Submission:
    """One API request's work: each prompt is run once per entry of `params` (the n choices, which differ by seed).

    `images` are the prepared images of a chat's one prompt, one image token each in it, in order; `boundaries` are
    the prompt positions where its messages end. `prompt_param` is the request field a refused prompt is named by."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    images: list[PreparedImage] | None = None
    boundaries: tuple[int, ...] = ()
    prompt_param: str = "prompt"


@dataclass(frozen=True)
class Work:
    """A Submission for the engine's thread; `reply` gets every choice's stream, or Refused."""

    submission: Submission
    reply: Future


@dataclass(frozen=True)
class Abort:
    """Stop a request wherever it is; applied between steps (never inside one)."""

    request_id: str


@dataclass(frozen=True)
class Query:
    """Run `ask(engine)` on the engine's thread between steps (a stats snapshot, a cache flush); `reply` gets its
    answer."""

    ask: Callable
    reply: Future


def check(info: EngineInfo, submission: Submission) -> None:
    """The checks that are pure arithmetic on a request (the caller's thread): the number of choices, and logit_bias
    against the vocabulary; Refused naming the field."""
    _check_choices(info.admission, submission.prompts, len(submission.params), submission.params[0].max_tokens)
    vocab = info.vocab_size
    for params in submission.params:
        outside = next((token for token, _ in params.logit_bias if token >= vocab), None)
        if outside is not None:
            raise Refused(400, f"logit_bias: token id {outside} is outside the vocabulary (0..{vocab - 1})",
                          param="logit_bias")


def _check_choices(policy: AdmissionPolicy, prompts: list[list[int]], choices: int, max_tokens: int | None) -> None:
    """More choices than the limit, or than the engine can ever hold at once, is a 400 naming `n`."""
    total = len(prompts) * choices
    if total > MAX_CHOICES:
        raise Refused(400, f"n × prompts = {choices} × {len(prompts)} exceeds the limit of {MAX_CHOICES} choices per "
                           f"request", param="n")
    shortest = min(len(p) for p in prompts)
    if total > 1 and policy.refusal(shortest, max_tokens) is None:
        most = policy.most_at_once(shortest, max_tokens)
        if total > most:  # its own copies would fill the queue: 429 forever, so say it can never run as sent
            raise Refused(400, f"n × prompts = {choices} × {len(prompts)} = {total} choices, but this server holds "
                               f"at most {most} requests of this size at once (running beside each other, plus "
                               f"--max-queue {policy.max_queue} waiting): lower n or max_tokens", param="n")


def image_refusal(info: EngineInfo, count: int, where: str | None = None) -> Refused | None:
    """Why a request may not bring `count` images (`where`: the JSON path of its first), or None."""
    if not info.accepts_images:
        return Refused(400, f"{where}: {info.images_refusal}" if where else info.images_refusal, param=where,
                       code="images_not_supported")
    limit = info.image_limits.max_images
    if count > limit:
        return Refused(400, f"{count} images in one request, over the limit of {limit} (--max-images-per-request)",
                       param="messages", code="too_many_images")
    return None


def prepare_images(info: EngineInfo, sources: list[ImageSource], local_root: str | None) -> list[PreparedImage]:
    """Read and preprocess a request's images (blocking); any problem is Refused naming the image.

    `local_root` (--allowed-local-media-path) is where file:// URLs may point; without it they are refused."""
    if not sources:
        return []
    refusal = image_refusal(info, len(sources), sources[0].where)
    if refusal is not None:
        raise refusal
    prepared = []
    for source in sources:
        try:
            data = read_source(source, info.image_limits, local_root)
            prepared.append(preprocess(data, info.image_limits, info.image_settings))
        except ImageError as e:
            raise Refused(400, f"{source.where}: {e}", param=source.where, code="invalid_image") from None
    return prepared


def describe(engine) -> EngineInfo:
    """The EngineInfo of a loaded engine (Engine.info)."""
    loaded = engine.loaded
    return EngineInfo(
        model_name=engine.model_name, model_path=str(loaded.path), model_type=loaded.config.get("model_type"),
        architectures=tuple(loaded.config.get("architectures") or ()), context_length=engine.context_length,
        vocab_size=engine.vocab_size, eos_token_ids=engine.eos_token_ids, prefix_cache=engine.prefix_cache is not None,
        max_prefill_tokens=engine.config.prefill_chunk_tokens, budget=engine.budget,
        accepts_images=engine.accepts_images, images_refusal=engine.images_refusal(),
        image_marker=_image_marker(engine), image_limits=engine.image_limits, image_settings=engine.image_settings,
        admission=engine.admission)


def _image_marker(engine) -> str:
    """The text the chat template's image placeholder is: vision_start, the image token, vision_end."""
    if not engine.accepts_images:
        return ""
    config = engine.loaded.config
    ids = [config.get("vision_start_token_id"), engine.image_token_id, config.get("vision_end_token_id")]
    return engine.tokenizer.decode([i for i in ids if i is not None], skip_special_tokens=False)
