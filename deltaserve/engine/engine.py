"""The engine: one model on one device, its pools sized by the ledger, and the step loop; plus the offline `LLM`.

`Engine(config)` plans the budget before anything is allocated, loads the model, allocates the KV and state pools
once at the granted size, and logs predicted vs measured bytes. `start()` runs the step loop on the engine's own
thread, which from then on alone admits, schedules, runs, samples, completes and aborts: other threads hand it
messages through one queue (engine/door.py: Work, Abort, Query) and never touch its state, so no lock is shared with
the server's event loop and no KV or state copy runs there. The server enters through `submit_all` (a future of
every choice's stream, or Refused) and reads `info`; `submit`, `stats` and `flush_cache` called from another thread
wait for the engine's answer. Without `start()`, the calling thread owns the engine and drives it with `step()`.
An exception inside a step fails that step's requests with finish_reason "error", never the loop.

A step holds its requests' pages and state slots from `schedule` to `complete`, so an abort raised from inside a
step (a hook) is queued and applied as that step ends: freeing under a running forward would let the next admission
take the same slot mid-step (PoolCorruption, and every co-batched request failed). Error text reaching a client
never carries a request's content: see engine/errors.py.

One file over 500 lines on purpose: the pools and the step loop that owns them are one concern; the door's checks
live in door.py, speculation in speculative.py, admission in admission.py and scheduler.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import queue
import random
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from deltaserve.budget import Budget, default_model_path, measure_vs_predicted, plan_budget, spec_from_checkpoint
from deltaserve.cache.kv_pool import KVPool
from deltaserve.cache.prefix import CheckpointPool, PrefixCache
from deltaserve.cache.state_pool import StatePool
from deltaserve.config import EngineConfig, device_memory_bytes, int8_activation_panels
from deltaserve.images import ImageLimits, PreparedImage, PreprocessorSettings
from deltaserve.engine import door
from deltaserve.engine.admission import AdmissionPolicy
from deltaserve.engine.door import Abort, EngineInfo, Query, Submission, Work
from deltaserve.engine.errors import Refused, internal_error
from deltaserve.engine.grammar import GrammarError, Grammars
from deltaserve.engine.loader import LoadedModel, load_model, return_freed_memory
from deltaserve.engine.multimodal import ImagePromptError, PromptImages, expand_prompt
from deltaserve.engine.request import Request, RequestStream, SamplingParams, TokenLogprob
from deltaserve.engine.runner import ModelRunner
from deltaserve.engine.sampler import sample
from deltaserve.engine.mtp_drafter import MtpDrafter
from deltaserve.engine.speculative import NgramDrafter, Speculation, verify_step
from deltaserve.engine.scheduler import QueueFull, RequestRefused, Scheduler
from deltaserve.kernels import decode_cpu, fused_cpu, int4_cpu, int4_int8, linear_cpu, paged_cpu, prefill_cpu
from deltaserve.models.arena import pack_weights

__all__ = ["Completion", "Engine", "EngineStats", "LLM", "QueueFull", "RequestRefused"]

IDLE_WAIT_S = 0.5  # the idle loop waits this long for a message before it re-checks for shutdown
STEP_TIME_SMOOTHING = 0.2  # weight of the newest step in the running step-time estimate
# Where `Engine.step_hook` is called, in order, on the engine's thread (the hook may call abort or submit).
STEP_POINTS = ("before_schedule", "after_schedule", "during_forward", "after_sampling", "before_complete")


@dataclass
class EngineStats:
    """A snapshot of the engine's queues, pools and counters."""

    waiting: int
    running: int
    kv_pages_used: int
    kv_pages_reserved: int
    kv_pages_total: int
    state_slots_used: int
    state_slots_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    finished: dict[str, int]
    refused: dict[str, int]
    prefix_cache_pages: int = 0  # pages the prefix cache holds (some shared with running requests); those it alone
    # holds are not in kv_pages_used: they count as free and are evicted when a request needs them
    prefix_cache_hit_tokens_total: int = 0
    prefix_cache_evicted_pages_total: int = 0
    checkpoints_used: int = 0
    checkpoints_total: int = 0
    checkpoints_evicted_total: int = 0
    speculative_drafted_total: int = 0  # draft tokens verified (--speculative), and those accepted
    speculative_accepted_total: int = 0
    speculative_verify_steps_total: int = 0


class Engine:
    """Serves many requests at once on one device; see the module docstring."""

    def __init__(self, config: EngineConfig, *, log=print):
        kind = config.device_kind()
        self.config = config.for_device(kind)
        self._log = log or (lambda message: None)
        started = time.monotonic()
        # The ledger comes first: nothing is allocated before it says the device can hold it.
        path = config.model or str(default_model_path())
        total, free = device_memory_bytes(kind)
        self.budget: Budget = plan_budget(spec_from_checkpoint(path), config, device_total_bytes=total,
                                          device_kind=kind, device_free_bytes=free)
        # --speculative auto is decided by the ledger (budget/advice.py auto_speculation), and so are the settings
        # fitted to the device (budget/fit.py; its note is logged below, once)
        self.config = dataclasses.replace(self.config, speculative=self.budget.speculative, **self.budget.fitted)
        self._log(self.budget.to_table())
        for note in self.budget.notes:  # e.g. --max-total-tokens rounded down to whole pages
            self._log(f"note: {note}")
        loaded = load_model(config.model, dtype=getattr(torch, self.config.dtype), device=self.config.device,
                            dequantize=self.config.dequantize_weights, vision=not config.language_model_only,
                            mtp=self.config.speculative == "mtp")
        self._setup(loaded)
        self._log(f"deltaserve: {loaded.name} ready {time.monotonic() - started:.1f} s after the engine started")

    def _setup(self, loaded: LoadedModel) -> None:
        c, budget = self.config, self.budget
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = c.served_model_name or loaded.name
        self.context_length = budget.max_context_tokens
        self.eos_token_ids = loaded.eos_token_ids
        self.device = torch.device(c.device)
        if self.device.type == "cpu":
            self._prepare_cpu_weights(loaded)
        geometry = loaded.model.geometry
        self.kv_pool = KVPool(geometry, budget.kv_pages, budget.page_size, dtype=getattr(torch, c.kv_dtype),
                              device=self.device)
        self.state_pool = StatePool(geometry, budget.state_slots, dtype=getattr(torch, c.state_dtype),
                                    device=self.device)
        self.checkpoint_pool = None
        self.prefix_cache = None
        # GDN states a forward writes from inside a chunk: the prefix cache's checkpoints, then speculation's
        # per-draft snapshots (engine/speculative.py), one storage so one set of tensors reaches the model
        draft_slots = budget.state_slots * c.speculative_tokens if c.speculative != "off" else 0
        ckpt_slots = budget.checkpoint_slots if c.prefix_cache else 0
        snapshots = (StatePool(geometry, ckpt_slots + draft_slots, dtype=getattr(torch, c.state_dtype),
                               device=self.device) if geometry.gdn_layers and ckpt_slots + draft_slots else None)
        if c.prefix_cache:
            if geometry.gdn_layers:
                self.checkpoint_pool = CheckpointPool(snapshots.view(0, ckpt_slots))
            self.prefix_cache = PrefixCache(self.kv_pool, self.checkpoint_pool)
        self.speculation = None
        self.mtp_drafter = None
        if c.speculative == "mtp":  # the ledger refused a checkpoint without a head (budget/lines.py)
            self.mtp_drafter = MtpDrafter(loaded.model, self.kv_pool, paged_kernel=c.attention_backend == "paged")
        if c.speculative != "off":
            self.speculation = Speculation(self.mtp_drafter or NgramDrafter(), c.speculative_tokens, snapshot_pool=(
                snapshots.view(ckpt_slots, draft_slots) if snapshots is not None else None))
        # the ledger's numbers admission decides by: the scheduler's, and EngineInfo's for the door's checks
        self.admission = policy = AdmissionPolicy.from_budget(budget, c.max_queue)
        self.scheduler = Scheduler(self.kv_pool, self.state_pool, policy, prefill_chunk_tokens=c.prefill_chunk_tokens,
                                   token_names=self.tokenizer.token_str, prefix_cache=self.prefix_cache,
                                   checkpoint_interval_tokens=c.checkpoint_interval_tokens,
                                   speculation=self.speculation)
        self.runner = ModelRunner(loaded.model, self.kv_pool, self.state_pool, self.device,
                                  paged_kernel=c.attention_backend == "paged",
                                  snapshot_pool=snapshots)
        self.vocab_size = int(loaded.model.lm_head.out_features)
        self._setup_images(loaded)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # door messages from other threads, in order
        self._live: dict[str, Request] = {}
        self._seeds = random.Random(c.seed)  # seeds of requests that name none: reproducible per engine start
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._in_step = False  # a plan is out: its requests' pages and slots must not be freed
        self._pending_aborts: list[str] = []
        # Tests set this to act at a precise point of a step (STEP_POINTS); called as hook(point).
        self.step_hook: Callable[[str], None] | None = None
        measured = {name: n for name, n in self.measured_bytes().items() if n or budget.line(name).bytes}
        for check in measure_vs_predicted(budget, measured):
            self._log(f"measured {check}")

    def _prepare_cpu_weights(self, loaded: LoadedModel) -> None:
        """The CPU kernels loaded and the weights in their final form (int8-activation layers, one buffer of 2 MB
        pages) before any pool is allocated: a conversion's transient copy (one tensor) then sits beside the weights
        alone, never beside the KV, state and checkpoint pools, so the load peaks below the ledger's total."""
        c = self.config
        if c.dtype != "float32":  # the native kernels are float32: the log line says what that costs
            self._log(f"note: --dtype {c.dtype} on CPU: the native kernels take float32 only, so each step goes "
                      "op by op in torch (decode ~3x slower than float32 here); float32 is the CPU default")
        _keep_step_memory()
        fused_cpu.load(self._log)  # each built once per machine (~1 min), then loaded from torch's cache
        linear_cpu.load(self._log)
        int4_cpu.load(self._log)
        if c.prefill_dtype == "bfloat16" and c.activation_dtype == "int8":
            self._log("note: --prefill-dtype bfloat16 rounds float32 activations: under --activation-dtype int8 "
                      "(the default) packed 4-bit layers take prefill rows as int8 already (faster); pass "
                      "--activation-dtype float32 for the bfloat16 prefill")
        elif c.prefill_dtype == "bfloat16":
            self._bf16_prefill(loaded.model)
        if int8_activation_panels(c.device, c.activation_dtype):
            self._int8_activations(loaded.model)
        if c.attention_backend == "paged":
            paged_cpu.load(self._log)
            prefill_cpu.load(self._log)
            decode_cpu.load(self._log)  # a decode step's layers in two native calls each
        moved = pack_weights(loaded.model, return_freed_memory)  # in one buffer of 2 MB pages (models/arena.py)
        if moved:
            self._log(f"weights: {moved / 2 ** 20:,.1f} MiB moved into one buffer, transparent huge pages asked for")

    def _setup_images(self, loaded: LoadedModel) -> None:
        """Image input, where the model has a vision tower loaded: the limits and the checkpoint's preprocessing."""
        c = self.config
        self.vision = getattr(loaded.model, "visual", None)
        self.image_limits = ImageLimits(max_images=c.max_images_per_request, max_bytes=c.max_image_bytes,
                                        max_pixels=c.max_image_pixels,
                                        min_pixels=min(ImageLimits.min_pixels, c.max_image_pixels))
        self.image_settings = None
        if self.vision is not None:
            self.image_settings = s = PreprocessorSettings.from_checkpoint(
                loaded.path if loaded.path.is_dir() else None, loaded.config["vision_config"])
            self.image_limits = s.limits(c.max_images_per_request, c.max_image_bytes, c.max_image_pixels)
            if s.max_pixels > c.max_image_pixels:
                self._log(f"note: images are resized to at most {c.max_image_pixels:,} pixels (--max-image-pixels), "
                          f"below the checkpoint's {s.max_pixels:,}: larger images get fewer tokens than "
                          f"transformers gives them")
            self.image_token_id = loaded.model.image_token_id

    @property
    def accepts_images(self) -> bool:
        return self.vision is not None and self.image_limits.max_images > 0

    def images_refusal(self) -> str:
        """Why this server takes no images (for the 400 an image request gets)."""
        if self.vision is None:
            if self.config.language_model_only:
                return "this server serves the language model only (--language-model-only): it takes no images"
            return f"the model {self.model_name} has no vision tower: it takes no images"
        return "this server takes no images (--max-images-per-request 0)"

    def _bf16_prefill(self, model) -> None:
        """--prefill-dtype bfloat16: every packed 4-bit layer's GEMM rows on AVX512-BF16 dot products, where this
        CPU and build have them (else said, and float32 stays)."""
        from deltaserve.models.layers import Int4Linear

        layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
        if not int4_cpu.has_bf16():
            self._log("note: --prefill-dtype bfloat16 needs AVX512-BF16 (and the native kernel build): not here, "
                      "so prefill stays float32")
        elif not layers:
            self._log("note: --prefill-dtype bfloat16 applies to packed 4-bit weights: this model has none, so "
                      "prefill stays float32")
        else:
            for layer in layers:
                layer.prefill_bf16 = True
            self._log(f"prefill: {len(layers)} packed 4-bit layers multiply GEMM rows (steps of more than "
                      f"{int4_cpu.MAX_ROWS}) in bfloat16")

    def _int8_activations(self, model) -> None:
        """--activation-dtype int8: every packed 4-bit and untied int8 layer the int8 dot-product kernel serves takes
        it (the others, and every layer where the kernel cannot be built, keep float32: said)."""
        from deltaserve.models.int8_activations import use_int8_activations
        from deltaserve.models.layers import Int4Linear, Int8DotLinear, Int8Linear

        if not any(type(m) is Int4Linear or (type(m) is Int8Linear and not m.tied) for m in model.modules()):
            return  # no packed 4-bit or int8 layer: nothing to take int8 activations (and no kernel to build for it)
        if int4_int8.load(self._log) is None:
            self._log("note: --activation-dtype int8 needs the int8 dot-product kernel, not built here: float32 stays")
            return
        # a fresh load: nothing outside the model holds its weights
        swapped, refusals = use_int8_activations(model, release=return_freed_memory, in_place=True,
                                                 compact=bool(self.config.compact_weights))
        for line in refusals:
            self._log(line)
        kinds = Counter(f"{m.bits}-bit" if m.bits != 4 else "IQ4" if m.levels is not None else "4-bit"
                        for m in model.modules() if isinstance(m, Int8DotLinear))
        self._log(f"activations: {swapped} layers ({', '.join(f'{k} {n}' for k, n in kinds.items())}) multiply int8 "
                  f"activations ({int4_int8.isa()} integer dot products)")

    def measured_bytes(self) -> dict[str, int]:
        """What the engine really holds per ledger line (torch tensor bytes)."""
        # the state dict: parameters and persistent buffers (packed int4 weights), not derived ones (rotary)
        state = self.loaded.model.state_dict()
        weights = {t.data_ptr(): t.numel() * t.element_size() for n, t in state.items() if not n.startswith("visual.")}
        vision = {t.data_ptr(): t.numel() * t.element_size() for n, t in state.items() if n.startswith("visual.")}
        return {"weights": sum(weights.values()), "vision_weights": sum(vision.values()),
                "kv_pool": self.kv_pool.bytes, "state_pool": self.state_pool.bytes,
                "checkpoint_pool": self.checkpoint_pool.bytes if self.checkpoint_pool is not None else 0,
                "speculative_states": (self.speculation.snapshot_pool.bytes
                                       if self.speculation and self.speculation.snapshot_pool else 0)}

    # -- requests ---------------------------------------------------------------------------------------------

    @functools.cached_property
    def info(self) -> EngineInfo:
        """What the server may read of this engine (engine/door.py)."""
        return door.describe(self)

    def submit_all(self, submission: Submission) -> Future:
        """The server's one door (any thread; never blocks): the door's arithmetic checks here (Refused at once),
        then a future of every choice's stream, or of Refused and none of them running, answered by the engine's
        thread. See door.py."""
        door.check(self.info, submission)
        work = Work(submission, Future())
        self._deliver(work)
        return work.reply

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               images: list[PreparedImage] | None = None, boundaries: tuple[int, ...] = ()) -> RequestStream:
        """Queue one request: its stream, or RequestRefused / QueueFull. From another thread than the engine's it
        waits for the engine's answer.

        With `images` (deltaserve/images.py), the prompt holds one image token per image, in order: each is widened
        into the image's tokens, so admission counts them. `boundaries`: prompt positions where chat messages end,
        where the prefix cache keeps GDN checkpoints (counted before the images are widened)."""
        if self._owns():
            return self._admit(prompt_ids, params, request_id, images, boundaries)
        return self._ask(lambda engine: engine._admit(prompt_ids, params, request_id, images, boundaries))

    def _admit(self, prompt_ids, params: SamplingParams, request_id: str | None, images, boundaries) -> RequestStream:
        """Admission of one request, on the owning thread."""
        prompt_ids = list(map(int, prompt_ids))  # C loops here and below: an 11K-token prompt took 4 ms in Python
        prompt_images = None
        if images or (self.vision is not None and self.image_token_id in prompt_ids):  # no image tokens alone
            prompt_ids, prompt_images = self._expand_images(prompt_ids, images or [])
        if not prompt_ids:
            raise RequestRefused("the prompt is empty: send at least one token", 400, "invalid_prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            bad = next(t for t in prompt_ids if not 0 <= t < self.vocab_size)
            raise RequestRefused(f"prompt token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}",
                                 400, "invalid_prompt")
        request_id = request_id or uuid.uuid4().hex
        grammar = None
        if params.grammar is not None:  # compiled here: a bad grammar is refused, never met inside a step
            try:
                grammar = (self.grammars, self.grammars.matcher(params.grammar))
            except GrammarError as e:
                raise RequestRefused(str(e), 400, "invalid_grammar") from None
        if request_id in self._live and not self._live[request_id].finished:
            raise RequestRefused(f"request id {request_id!r} is already in use", 400, "duplicate_request_id")
        reservation = self.scheduler.admit(len(prompt_ids), params.max_tokens)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = Request(
            request_id, prompt_ids, params,
            max_new_tokens=min(reservation.max_new_tokens, self.context_length - len(prompt_ids)),
            reserved_pages=reservation.kv_pages, stream=RequestStream(request_id, len(prompt_ids)),
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids, generator=torch.Generator(self.device).manual_seed(seed),
            arrival_s=time.monotonic(), reservation=reservation, grammar=grammar, images=prompt_images,
            boundaries=_widened(boundaries, prompt_images, len(prompt_ids)))
        self._live[request_id] = request
        self.scheduler.add(request)
        return request.stream

    def _admit_work(self, submission: Submission) -> list[RequestStream]:
        """Every choice of every prompt admitted (prompt-major order), or Refused and none of them left running."""
        base_id = uuid.uuid4().hex
        streams: list[RequestStream] = []
        try:
            for prompt_ids in submission.prompts:
                for params in submission.params:
                    streams.append(self._admit(prompt_ids, params, f"{base_id}-{len(streams)}", submission.images,
                                               submission.boundaries))
        except Refused as e:
            for stream in streams:
                self._abort_now(stream.request_id)
            if e.status == 400 and e.param is None:
                e.param = submission.prompt_param
            raise
        return streams

    def _expand_images(self, prompt_ids: list[int], images: list[PreparedImage]):
        refusal = door.image_refusal(self.info, len(images))  # the same limits the server's image reading holds
        if refusal is not None:
            raise RequestRefused(refusal.message, refusal.status, refusal.code)
        try:
            return expand_prompt(prompt_ids, images, self.image_token_id, self.vision.merge)
        except (ImagePromptError, StopIteration) as e:
            raise RequestRefused(str(e), 400, "invalid_prompt") from None

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (any thread; never blocks). On the owning thread between steps its pages
        and slot are free when this returns; otherwise the abort is applied as the step in flight ends."""
        if self._owns() and not self._in_step:
            self._abort_now(request_id)
        elif self._owns():
            self._pending_aborts.append(request_id)
        else:
            self._deliver(Abort(request_id))

    def _abort_now(self, request_id: str) -> None:
        request = self._live.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request)

    def _apply_pending_aborts(self) -> None:
        pending, self._pending_aborts = self._pending_aborts, []
        for request_id in pending:
            self._abort_now(request_id)

    def flush_cache(self) -> int:
        """Drop every cached page and checkpoint no running request uses; returns pages freed. From another thread
        than the engine's it waits for the engine's answer."""
        if not self._owns():
            return self._ask(Engine.flush_cache)
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    def stats(self) -> EngineStats:
        """A snapshot of the queues, pools and counters. From another thread than the engine's it waits for the
        engine's answer (taken between steps)."""
        if not self._owns():
            return self._ask(Engine.stats)
        s = self.scheduler
        return EngineStats(
            waiting=len(s.waiting), running=len(s.running), kv_pages_used=self.kv_pool.used_pages - (
                self.prefix_cache.evictable_pages() if self.prefix_cache is not None else 0),
            kv_pages_reserved=s.ledger.in_use_kv_pages, kv_pages_total=self.kv_pool.num_pages,
            state_slots_used=self.state_pool.used_slots, state_slots_total=self.state_pool.num_slots,
            prompt_tokens_total=s.prompt_tokens_total, generation_tokens_total=s.generation_tokens_total,
            finished=dict(s.finished_by_reason), refused=dict(s.refused_by_reason), **self._cache_stats(),
            **self._speculative_stats())

    # -- the engine's thread and its messages -----------------------------------------------------------------

    def _owns(self) -> bool:
        """The calling thread owns the engine's state: the engine's thread once started, else whoever drives it."""
        thread = self._thread
        return thread is None or thread is threading.current_thread()

    def _deliver(self, message) -> None:
        """Hand a message to the owning thread: queued from another thread, handled at once on the owning one."""
        if not self._owns():
            self._inbox.put(message)
        elif isinstance(message, Abort):
            self.abort(message.request_id)
        else:
            self._handle(message)

    def _ask(self, ask: Callable):
        """Run `ask(self)` on the engine's thread and wait for its answer (or its exception)."""
        query = Query(ask, Future())
        self._deliver(query)
        return query.reply.result()

    def _handle(self, message) -> None:
        """One door message, on the owning thread between steps; its answer goes to its future."""
        if isinstance(message, Abort):
            self._abort_now(message.request_id)
            return
        if not message.reply.set_running_or_notify_cancel():
            return  # the caller gave up waiting (its client left before the engine read this)
        try:
            answer = (self._admit_work(message.submission) if isinstance(message, Work) else message.ask(self))
        except BaseException as e:  # Refused, or a bug: the caller learns of it, the loop goes on
            message.reply.set_exception(e)
        else:
            message.reply.set_result(answer)

    def _handle_inbox(self, wait_s: float = 0.0) -> None:
        """Every message queued so far, in order (waiting up to `wait_s` for the first when there is none)."""
        try:
            message = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _speculative_stats(self) -> dict[str, int]:
        spec = self.speculation
        return {} if spec is None else dict(speculative_drafted_total=spec.drafted_total,
                                            speculative_accepted_total=spec.accepted_total,
                                            speculative_verify_steps_total=spec.verify_steps_total)

    def _cache_stats(self) -> dict[str, int]:
        cache, ckpt = self.prefix_cache, self.checkpoint_pool
        if cache is None:
            return {}
        return dict(prefix_cache_pages=cache.cached_pages, prefix_cache_hit_tokens_total=cache.hit_tokens_total,
                    prefix_cache_evicted_pages_total=cache.evicted_pages_total,
                    checkpoints_used=ckpt.used_slots if ckpt else 0, checkpoints_total=ckpt.num_slots if ckpt else 0,
                    checkpoints_evicted_total=cache.evicted_checkpoints_total)

    # -- the step loop ----------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one step on the owning thread (the caller's when the background loop is not started); False when
        idle."""
        if not self._owns():
            raise RuntimeError("Engine.step() called while the background loop runs; use one or the other")
        self._hook("before_schedule")
        encoded = self._encode_one_image()
        started = time.perf_counter()  # the step's time includes its planning: an MTP head drafts there
        try:
            plan = self.scheduler.schedule()
        except Exception as e:  # a bug in scheduling: fail what is running, keep serving
            self._fail(list(self.scheduler.running), e)
            return True
        if plan is None:
            return encoded
        self._in_step = True
        try:
            with fused_cpu.denormals_flushed(self.device.type == "cpu"):  # for the step only: csrc/fused.cpp
                self._run(plan, started)
        finally:
            self._in_step = False
            self._apply_pending_aborts()
        return True

    def _encode_one_image(self) -> bool:
        """Run the vision tower on one image a running request needs next: between two steps, so the decode of the
        others waits for at most one image (bounded by --max-image-pixels), never a whole batch."""
        found = next(((r, k) for r in self.scheduler.running if r.images is not None and not r.finished
                      for k in [r.images.next_to_encode(r.num_cached)] if k is not None), None)
        if found is None:
            return False
        request, k = found
        try:
            image = request.images.prepared[k]
            with torch.inference_mode():
                embeds = self.loaded.model.encode_images(image.patches.to(self.device), [image.grid])
            request.images.embeds[k] = embeds
        except Exception as e:  # torch.OutOfMemoryError included: this request fails, the others go on
            self._fail([request], e)
        return True

    def _run(self, plan, started: float) -> None:
        """Forward, sample and complete one planned step (planned from `started` on, perf_counter seconds); failures
        fail only the requests they belong to."""
        fed = [(request, request.num_cached, n) for request, n in plan.sequences]  # what the MTP head reads after
        try:
            self._hook("after_schedule")
            logits, argmax = self.runner.forward(plan)
            self._hook("during_forward")
            # a plain step samples each request's row; a step that verifies drafts is speculation's own
            sampled = verify_step(logits, plan, argmax) if plan.drafts else sample(logits, plan.sampling, argmax)
            self._hook("after_sampling")
            self._hook("before_complete")
        except Exception as e:  # includes torch.OutOfMemoryError: this step's requests fail, not the process
            self._fail(plan.requests, e)
            return
        try:
            for request, error in self.scheduler.complete(plan, sampled):
                self.scheduler.finish(request, "error", internal_error(
                    self._log, f"request {request.request_id} failed while completing a step", error))
        except Exception as e:
            self._fail(plan.requests, e)
        if self.mtp_drafter is not None:
            try:
                if plan.observe:
                    observing = time.perf_counter()
                    self.mtp_drafter.observe(fed)
                    if not plan.prefill:
                        self.speculation.observed(time.perf_counter() - observing)
                else:  # a crowded step: its requests are not read by the head, nor drafted for again
                    self.mtp_drafter.retire(plan.requests)
            except Exception as e:
                self._fail([r for r in plan.requests if not r.finished], e)
        for request in plan.requests:
            if request.finished and self._live.get(request.request_id) is request:
                del self._live[request.request_id]
        elapsed = time.perf_counter() - started
        s = self.scheduler
        s.seconds_per_token += STEP_TIME_SMOOTHING * (elapsed - s.seconds_per_token)
        if self.speculation is not None:
            self.speculation.observe(plan, elapsed)

    def _hook(self, point: str) -> None:
        if self.step_hook is not None:
            self.step_hook(point)

    def _fail(self, requests: list[Request], error: Exception) -> None:
        """Fail a whole step's requests: the client sees an error id, the log the detail (which may hold ids)."""
        message = internal_error(self._log, f"a step failed for {len(requests)} requests", error)
        self.scheduler.fail(requests, message)
        for request in requests:
            self._live.pop(request.request_id, None)

    def start(self) -> None:
        """Run the step loop on the engine's own thread, which owns the engine's state from now on."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="deltaserve-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        """Between steps, every queued message; when idle, wait for one."""
        while not self._stopping:
            self._handle_inbox(wait_s=0.0 if self.scheduler.has_work else IDLE_WAIT_S)
            if self._stopping:
                return
            if self.scheduler.has_work:
                self.step()

    def shutdown(self) -> None:
        """Stop the loop, refuse the work still queued (503), and abort whatever is waiting or running."""
        self._stopping = True
        if self._thread is not None:
            self._inbox.put(Abort(""))  # wakes an idle loop: it aborts nothing, then sees _stopping
            self._thread.join()
            self._thread = None
        while True:  # the caller owns the engine now: what reached the queue too late is answered here
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(message, Work) and message.reply.set_running_or_notify_cancel():
                message.reply.set_exception(Refused(503, "the engine is shutting down", code="shutting_down"))
            elif not isinstance(message, Work):
                self._handle(message)
        self._pending_aborts.clear()
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.abort(request)
        self._live.clear()


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
STEP_HEAP_TRIM_BYTES = 1 << 30
STEP_HEAP_MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold (64-bit)


def _keep_step_memory() -> bool:
    """Keep the memory a step frees for the next step (glibc; elsewhere nothing changes).

    A CPU prefill step allocates and frees hundreds of MB of activations and widened weight tiles (SmolLM2's
    512-token chunk: ~400 MB). With glibc's defaults most of it went back to the OS at each free (mmap'd blocks,
    trimmed heaps: the engine thread's arena trims at 128 KB) and came back as fresh zeroed pages at the next step:
    ~70,000 page faults per 528-token SmolLM2 prompt, ~1,000 with these settings (allocations up to 32 MB from the
    heap, heaps trimmed only past 1 GB free at their top). What stays resident is a step's working memory, which the
    ledger counts already (prefill activations, workspaces). Called after the weights are loaded, so the loaders'
    transient buffers have gone back. False where the C library has no mallopt."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, STEP_HEAP_MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                  STEP_HEAP_TRIM_BYTES))


def _widened(boundaries, images: PromptImages | None, prompt_len: int) -> tuple[int, ...]:
    """Message boundaries counted on the prompt as sent, moved past the tokens its images were widened into."""
    moved = []
    for b in boundaries:
        shift = removed = 0
        for start, n in zip(images.starts, images.lengths) if images is not None else ():
            if start - removed < b:  # the placeholder (one token before widening) lies before the boundary
                shift += n - 1
            removed += n - 1
        moved.append(int(b) + shift)
    return tuple(sorted({b for b in moved if 0 < b <= prompt_len}))


@dataclass
class Completion:
    """One prompt's whole result from `LLM.generate`."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


class LLM:
    """Offline generation: `LLM().generate(prompts, SamplingParams(...))` runs the engine in this thread."""

    def __init__(self, model: str | None = None, *, log=None, **config_overrides):
        self.engine = Engine(EngineConfig(model=model, **config_overrides), log=log)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Generate for every prompt (text, or token ids), all batched together; results in prompt order."""
        params = params or SamplingParams()
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        pending = deque(range(len(prompts)))
        streams: list[RequestStream | None] = [None] * len(prompts)
        results = [Completion("", [], None, len(i), 0, None) for i in ids]
        while pending or not all(s.finished for s in streams if s is not None):
            while pending:  # more prompts than the queue holds: submit as room appears
                try:
                    streams[pending[0]] = self.engine.submit(ids[pending[0]], per_prompt[pending[0]])
                except QueueFull:
                    break
                pending.popleft()
            self.engine.step()
            for stream, result in zip(streams, results):
                if stream is not None:
                    _gather(result, stream)
        return results


def _gather(result: Completion, stream: RequestStream) -> None:
    for out in stream.drain():
        result.text += out.text
        result.token_ids += out.token_ids
        if out.logprobs is not None:
            result.logprobs = (result.logprobs or []) + out.logprobs
        result.completion_tokens = out.completion_tokens
        result.finish_reason, result.error = out.finish_reason, out.error
