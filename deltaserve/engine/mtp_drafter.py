"""--speculative mtp: drafts from the checkpoint's multi-token-prediction head (models/mtp.py), verified like any
drafts (engine/speculative.py: the verifier, the GDN rollback and the draft lengths are the same).

After every step (`observe`), the head runs over each request's rows the step kept, positions [before, num_cached):
row t pairs the target's hidden state at t (every row's, kept by the model's forward) with the token at t + 1 (the
prompt's next token, an accepted draft, or the token sampled this step), and writes the head's K/V at t (its layer
of the KV pool, the request's own page slots). Rejected draft rows are never fed to it. The kept rows of all the
step's requests go through the head in one pass (one read of its weights, not one a request). The last kept row's
output is kept until the request's next step; it becomes the first draft (greedy, through the vocabulary projection)
only when the request drafts, since a 248K-token projection costs a real model as much as a few layers. `propose`
chains the head from there: draft j + 1 from (h' of draft j's row, draft j), at position num_cached + j - 1, its K/V
written at that position's slot (the scheduler grows the request's pages first: `writes_ahead`). Nothing of the head
needs rolling back: a position past num_cached is never read before `observe` writes it again with the target's
hidden state. A step too crowded for drafts to pay (engine/speculative.py observing_pays) is not read: its requests
are retired (`retire`), since the head's K/V of theirs now has a hole.

On CPU the head's rows run as decode rows of the native blocks (models/mtp.py rows: its layer in one decode_stack
call, the target's decode path), elsewhere op by op, one request at a time: a head this small is mostly call
overhead.

Drafts are greedy (a point mass): the verifier's rejection sampling is exact for them at any temperature.
Requests with images are not drafted for (engine/speculative.py), nor observed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.kernels import decode_cpu
from deltaserve.models.batch import ModelCaches


@dataclass
class _Next:
    """What the head said after a request's last step: the hidden state its first draft comes from and later drafts
    chain from (the draft itself is read through the vocabulary projection only when the request drafts)."""

    cached: int  # the request's num_cached when it was computed (stale once it moved)
    hidden: torch.Tensor  # [H]


class MtpDrafter:
    """Drafts with `model.mtp`; its K/V live in `kv_pool`'s layer `model.mtp.kv_layer`. `paged_kernel`: the engine's
    attention backend is the paged one (the native blocks' condition)."""

    # propose writes the K/V of draft j's row at the position it would take (num_cached + j - 1): the scheduler makes
    # those pages exist first (scheduler.py _drafts)
    writes_ahead = True
    observes = True  # it reads every step's rows (observe), so a step may not pay for it: Speculation.observing_pays

    def __init__(self, model, kv_pool, paged_kernel: bool = True):
        self.model, self.head, self.kv_pool = model, model.mtp, kv_pool
        self.k_cache, self.v_cache = kv_pool.k[self.head.kv_layer], kv_pool.v[self.head.kv_layer]
        self.device = self.k_cache.device  # the pool's slot tables are host tensors; token ids are made here
        self.paged_kernel = paged_kernel
        none = [None] * self.head.kv_layer  # the target's layers: the head's own reads its K/V only
        self.caches = ModelCaches(k=none + [self.k_cache], v=none + [self.v_cache], conv=[], recurrent=[])
        self.next: dict[object, _Next] = {}

    def _logits_token(self, hidden: torch.Tensor) -> int:
        return int(self.model.lm_head(hidden[None]).float().argmax(-1))

    def _rows(self, tokens: torch.Tensor, hidden: torch.Tensor, start: int, slots: torch.Tensor,
              chain: list | None = None, native: bool = True) -> torch.Tensor:
        """The head over positions start .. start + n - 1 of one request whose page slots are `slots`, the rows'
        K/V written at their positions' slots: as decode rows of the native blocks where they serve (`native` and
        at most MAX_ROWS rows: a prompt chunk's rows are not decode rows, nor worth their [n, start + n] slot
        table), else op by op (models/mtp.py forward)."""
        n = tokens.shape[0]
        embeds = self.model.model.embed_tokens(tokens)
        if chain is None:
            if native and n <= decode_cpu.MAX_ROWS:
                out = self.head.decode_rows(tokens, embeds, hidden, start,
                                            slots[start:start + n], slots[:start + n].expand(n, -1).contiguous(),
                                            self.caches, self.paged_kernel)
                if out is not None:
                    return out
            return self.head(embeds, hidden, start, self.k_cache, self.v_cache, slots[:start].to(self.device),
                             write_slots=slots[start:start + n].to(self.device))
        return self.head(embeds, hidden, start, self.k_cache, self.v_cache, slots[:start - len(chain)].to(self.device),
                         chain=chain)

    @torch.no_grad()
    def observe(self, steps: list[tuple[object, int]]) -> None:
        """After a step: `steps` is (request, num_cached before the step, rows fed) in the forward's row order. The
        kept rows of every request go through the head together (`_observe_rows`); the last one of each is what its
        drafts start from. Retired requests are not read."""
        hidden, self.head.target_hidden = self.head.target_hidden, None
        work = []  # (request, before, kept, the request's rows of `hidden`)
        row = 0
        for request, before, fed in steps:
            first, row = row, row + fed
            if (request.finished or request.images is not None or hidden is None
                    or (request.speculative is not None and request.speculative.retired)):
                self.next.pop(request, None)
                continue
            kept = request.num_cached - before
            if kept > 0:
                work.append((request, before, kept, hidden[first:first + kept]))
        for (request, _, _, _), out in zip(work, self._observe_rows(work)):
            self.next[request] = _Next(request.num_cached, out[-1])
        for request in [r for r in self.next if r.finished]:
            self.next.pop(request)

    def _observe_rows(self, work: list) -> list[torch.Tensor]:
        """The head's output rows [kept, H] of each request in `work`: as decode rows of the native blocks, every
        request's rows in one pass (MAX_ROWS at a time; one read of the head's weights for them all, where one pass
        a request made 16 running requests pay 16 reads a step), else request by request (`_rows`)."""
        if not work:
            return []
        per_request = [token_range(r, before + 1, before + kept + 1) for r, before, kept, _ in work]
        slots = [self.kv_pool.slots(r) for r, _, _, _ in work]
        outs: list[torch.Tensor] = []
        i = 0
        while i < len(work):
            j, n = i, 0  # requests i .. j - 1 in this pass, n rows
            while j < len(work) and (j == i or n + work[j][2] <= decode_cpu.MAX_ROWS):
                n += work[j][2]
                j += 1
            chunk = work[i:j]
            out = None
            if n <= decode_cpu.MAX_ROWS:  # the slot tables only where the native blocks can take the rows
                tokens = torch.tensor([t for ts in per_request[i:j] for t in ts], dtype=torch.long,
                                      device=self.device)
                positions = [before + m for _, before, kept, _ in chunk for m in range(kept)]
                write = torch.cat([slots[r][before:before + kept] for r, (_, before, kept, _) in enumerate(chunk, i)])
                context = torch.nn.utils.rnn.pad_sequence([slots[r][:before + m + 1] for r, (_, before, kept, _)
                                                           in enumerate(chunk, i) for m in range(kept)],
                                                          batch_first=True)
                out = self.head.rows(tokens, self.model.model.embed_tokens(tokens),
                                     torch.cat([h for _, _, _, h in chunk]), positions, write, context,
                                     self.caches, self.paged_kernel)
            if out is None:  # a prompt chunk, another device, a mixture of experts: op by op, one request at a time
                for r, (_, before, _, h) in enumerate(chunk, i):
                    ids = torch.tensor(per_request[r], dtype=torch.long, device=self.device)
                    outs.append(self._rows(ids, h, before, slots[r], native=False))
            else:
                outs += list(out.split([kept for _, _, kept, _ in chunk]))
            i = j
        return outs

    def retire(self, requests) -> None:
        """These requests' rows of the last step were not read (a crowded step: Speculation.observing_pays): the
        head's K/V has a hole there, so they are never drafted for again."""
        for request in requests:
            self.next.pop(request, None)
            if request.speculative is not None:
                request.speculative.retired = True

    @torch.no_grad()
    def propose(self, request, k: int) -> list[int]:
        """Up to k greedy drafts for the tokens after the request's last one. Draft j + 1 comes from the row of
        (h' of draft j's row, draft j) at position num_cached + j - 1; its K/V goes to that position's slot, which
        the verifying step's target rows reach but the head's own never reads as kept: the next `observe` writes
        every kept position again before reading it. Where those slots are not there yet (a caller that did not
        grow the pages), the rows' K/V stay in a local list instead (op by op)."""
        state = self.next.get(request)
        if state is None or state.cached != request.num_cached or k <= 0:
            return []
        hidden = state.hidden
        drafts = [self._logits_token(hidden)]
        slots = self.kv_pool.slots(request)
        chain = None if len(slots) >= state.cached + k - 1 else []
        for j in range(1, k):
            token = torch.tensor([drafts[-1]], dtype=torch.long, device=self.device)
            hidden = self._rows(token, hidden[None], state.cached + j - 1, slots, chain)[0]
            drafts.append(self._logits_token(hidden))
        return drafts


def token_range(request, start: int, stop: int) -> list[int]:
    """The request's tokens (prompt, then output) at positions start .. stop - 1, without joining the two lists."""
    prompt = request.prompt_ids
    if stop <= len(prompt):
        return prompt[start:stop]
    if start >= len(prompt):
        return request.output_ids[start - len(prompt):stop - len(prompt)]
    return prompt[start:] + request.output_ids[:stop - len(prompt)]
