"""One forward per step: pack the plan's sequences (decode first) into a ForwardBatch and run the model once, on
the native decode stack where it serves the step (models/decode_stack_path.py), else the model's per-op forward.

Index tensors are built with torch ops from each request's slot tensor (kv_pool keeps it a page at a time), so a
step costs a few small ops per sequence, never Python work per token of context.
"""

from __future__ import annotations

import torch

from deltaserve.cache.kv_pool import KVPool
from deltaserve.cache.state_pool import StatePool
from deltaserve.engine.sampler import prompt_logprobs
from deltaserve.engine.scheduler import StepPlan
from deltaserve.kernels.int4 import decode_rows_first
from deltaserve.models.batch import ForwardBatch, ModelCaches
from deltaserve.models.decode_stack_path import DecodeStackPath


class ModelRunner:
    """Holds the model and the pools' views; `forward(plan)` returns the logits rows of `plan.sampling`."""

    def __init__(self, model, kv_pool: KVPool, state_pool: StatePool, device: torch.device | str = "cpu", *,
                 paged_kernel: bool = True, snapshot_pool: StatePool | None = None):
        self.model = model
        self.decode_path = DecodeStackPath.of(model)  # asked each step before the model's per-op forward
        self.paged_kernel = paged_kernel  # False: --attention-backend portable
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.device = torch.device(device)
        self._aranges: dict[int, torch.Tensor] = {}  # cu_q of a decode step of n rows: arange(n + 1), made once
        self.caches = ModelCaches(k=kv_pool.k, v=kv_pool.v, conv=state_pool.conv, recurrent=state_pool.recurrent,
                                  snapshot_conv=snapshot_pool.conv if snapshot_pool is not None else None,
                                  snapshot_recurrent=snapshot_pool.recurrent if snapshot_pool is not None else None)

    def build_batch(self, plan: StepPlan) -> ForwardBatch:
        """The packed batch of one step; positions and slots follow each request's cached length."""
        if not plan.prefill and not plan.verify and not plan.snapshots and not any(r.images for r in plan.decode):
            return self.decode_batch(plan)
        return self.packed_batch(plan)

    def packed_batch(self, plan: StepPlan) -> ForwardBatch:
        """build_batch of any step: decode rows, verifying requests' drafts, prefill chunks, images, GDN snapshots."""
        sequences = plan.sequences
        ids: list[int] = []
        q_lens, cached_lens, contexts, new_slots = [], [], [], []
        for request, n in sequences:
            start = request.num_cached
            if request.prefilled:
                ids.append(request.output_ids[-1])
                ids.extend(plan.drafts.get(request, ()))
            else:
                ids.extend(request.prompt_ids[start:start + n])
            slots = self.kv_pool.slots(request)
            q_lens.append(n)
            cached_lens.append(start)
            contexts.append(slots[: start + n])
            new_slots.append(slots[start: start + n])
        q = torch.tensor(q_lens, dtype=torch.long)
        cached = torch.tensor(cached_lens, dtype=torch.long)
        cu_q = torch.zeros(len(q_lens) + 1, dtype=torch.long)
        torch.cumsum(q, 0, out=cu_q[1:])
        total = int(cu_q[-1])
        # position of row t = t - (start row of its sequence) + (tokens its sequence already cached)
        positions = torch.arange(total) + torch.repeat_interleave(cached - cu_q[:-1], q)
        sampling = set(map(id, plan.sampling))
        # the last row of each sampling sequence; every row of a verifying one (row j scores draft j + 1)
        rows = [row for b, (request, _) in enumerate(sequences) if id(request) in sampling
                for row in range(int(cu_q[b]) if request in plan.drafts else int(cu_q[b + 1]) - 1, int(cu_q[b + 1]))]
        # after them, the rows that score a prompt_logprobs request's next prompt token (all but the prompt's last)
        rows += [row for b, (request, n) in enumerate(sequences) if request.params.prompt_logprobs is not None
                 and not request.prefilled
                 for row in range(int(cu_q[b]), int(cu_q[b]) + min(n, request.prompt_len - 1 - request.num_cached))]
        state_slots = [self.state_pool.slot(request) for request, _ in sequences]
        to = self.device
        images = self.image_inputs(plan, positions, cu_q) if any(r.images for r, _ in sequences) else {}
        index = {id(request): b for b, (request, _) in enumerate(sequences)}
        snapshots = tuple(sorted([(index[id(r)], p - r.num_cached, slot) for r, p, slot in plan.snapshots]
                                 + [(index[id(r)], read, slot) for r, read, slot in plan.draft_snapshots]))
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long).to(to),
            positions=positions.to(to),
            q_lens=q_lens,
            cached_lens=cached_lens,
            num_decode=len(plan.decode),
            cu_q=cu_q.to(to),
            slot_mapping=torch.cat(new_slots).to(to),
            context_slots=torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True).to(to),
            state_slots=torch.tensor(state_slots, dtype=torch.long).to(to),
            logits_indices=torch.tensor(rows, dtype=torch.long).to(to),
            paged_kernel=self.paged_kernel,
            snapshots=snapshots,
            **{name: t.to(to) for name, t in images.items()},
        )

    def decode_batch(self, plan: StepPlan) -> ForwardBatch:
        """build_batch of a step of decode rows only (text): the same batch from a third of the small ops. Its token
        ids, positions, state slots and logits rows are views of one tensor made from one list."""
        decode = plan.decode
        n = len(decode)
        cached = [r.num_cached for r in decode]
        tables = [self.kv_pool.slots(r) for r in decode]
        contexts = [t[: c + 1] for t, c in zip(tables, cached)]
        sampling = set(map(id, plan.sampling))
        rows = [b for b, r in enumerate(decode) if id(r) in sampling]
        meta = torch.tensor([r.output_ids[-1] for r in decode] + cached + [self.state_pool.slot(r) for r in decode]
                            + [c + 1 for c in cached] + rows, dtype=torch.long)
        slot_mapping = contexts[0][-1:] if n == 1 else torch.cat([c[-1:] for c in contexts])
        context_slots = contexts[0][None] if n == 1 else torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True)
        cu_q = self._aranges.get(n + 1)
        if cu_q is None:
            cu_q = self._aranges[n + 1] = torch.arange(n + 1)
        batch = ForwardBatch(
            input_ids=meta[:n], positions=meta[n:2 * n], q_lens=[1] * n, cached_lens=cached, num_decode=n,
            cu_q=cu_q, slot_mapping=slot_mapping, context_slots=context_slots,
            state_slots=meta[2 * n:3 * n], logits_indices=meta[4 * n:], paged_kernel=self.paged_kernel)
        batch.decode_context_lens = meta[3 * n:4 * n]  # the cached property's value, from the same tensor
        if self.device.type != "cpu":
            for name in ("input_ids", "positions", "cu_q", "slot_mapping", "context_slots", "state_slots",
                         "logits_indices"):
                setattr(batch, name, getattr(batch, name).to(self.device))
        return batch

    @staticmethod
    def image_inputs(plan: StepPlan, positions: torch.Tensor, cu_q: torch.Tensor) -> dict[str, torch.Tensor]:
        """A step's image tokens (rows and the tower's embeddings) and the multimodal rotary positions of every
        row: a text-only sequence's are its positions on all three axes."""
        rope = positions.expand(3, -1).clone()
        rows, embeds = [], []
        for b, (request, n) in enumerate(plan.sequences):
            if request.images is None:
                continue
            first, start = int(cu_q[b]), request.num_cached
            rope[:, first: first + n] = request.images.positions(start, n)
            if not request.prefilled:
                offsets, parts = request.images.chunk(start, n)
                rows += [first + o for o in offsets]
                embeds += parts
        out = {"rope_positions": rope}
        if rows:
            out["image_rows"] = torch.tensor(rows, dtype=torch.long)
            out["image_embeds"] = torch.cat(embeds)
        return out

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits float32 [rows, vocab], in the order of plan.sampling: one row per request, 1 + k rows for a
        verifying request with k drafts; their argmax int64 [rows] where the model's head computed it, else None)."""
        batch = self.build_batch(plan)
        with decode_rows_first(batch.num_decode):  # --prefill-dtype bfloat16 rounds the prefill rows only
            out = self.decode_path.run(batch, self.caches)  # None: the native blocks do not serve this step
            logits = out.logits if out is not None else self.model(batch, self.caches)
        argmax = batch.logits_argmax
        sampled_rows = len(batch.logits_indices) - self.score_prompts(plan, logits)
        if sampled_rows < len(logits):
            logits = logits[:sampled_rows]
            argmax = None if argmax is None else argmax[:sampled_rows]
        return logits, argmax

    @staticmethod
    def score_prompts(plan: StepPlan, logits: torch.Tensor) -> int:
        """plan.prompt_scores from the prompt rows after the sampled ones (packed_batch's order); how many rows."""
        first = len(logits)
        for request, n in reversed(plan.prefill):
            if request.params.prompt_logprobs is None:
                continue
            count = min(n, request.prompt_len - 1 - request.num_cached)
            if count <= 0:
                continue
            first -= count
            start = request.num_cached + 1  # row j predicts prompt token num_cached + j + 1
            plan.prompt_scores[request] = prompt_logprobs(
                logits[first:first + count], request.prompt_ids[start:start + count], request.params.prompt_logprobs)
        return len(logits) - first
