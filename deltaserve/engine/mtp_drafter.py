"""--speculative mtp: drafts from the checkpoint's multi-token-prediction head (models/mtp.py), verified like any
drafts (engine/speculative.py: the verifier, the GDN rollback and the draft lengths are the same).

After every step (`observe`), the head runs over each request's rows the step kept, positions [before, num_cached):
row t pairs the target's hidden state at t (every row's, kept by the model's forward) with the token at t + 1 (the
prompt's next token, an accepted draft, or the token sampled this step), and writes the head's K/V at t (its layer
of the KV pool, the request's own page slots). Rejected draft rows are never fed to it. The last kept row's output
is the first draft (greedy) and its hidden state, kept until the request's next step. `propose` chains the head from
there: draft j + 1 from (h' of draft j's row, draft j), at the positions after num_cached; those provisional rows'
K/V stay in a local list and never reach the cache, so nothing of the head needs rolling back.

Drafts are greedy (a point mass): the verifier's rejection sampling is exact for them at any temperature.
Requests with images are not drafted for (engine/speculative.py), nor observed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Next:
    """What the head said after a request's last step: its first draft, and the hidden state to chain from."""

    cached: int  # the request's num_cached when it was computed (stale once it moved)
    token: int
    hidden: torch.Tensor  # [H]


class MtpDrafter:
    """Drafts with `model.mtp`; its K/V live in `kv_pool`'s layer `model.mtp.kv_layer`."""

    def __init__(self, model, kv_pool):
        self.model, self.head, self.kv_pool = model, model.mtp, kv_pool
        self.k_cache, self.v_cache = kv_pool.k[self.head.kv_layer], kv_pool.v[self.head.kv_layer]
        self.device = self.k_cache.device  # the pool's slot tables are host tensors; token ids are made here
        self.next: dict[object, _Next] = {}

    def _logits_token(self, hidden: torch.Tensor) -> int:
        return int(self.model.lm_head(hidden[None]).float().argmax(-1))

    @torch.no_grad()
    def observe(self, steps: list[tuple[object, int]]) -> None:
        """After a step: `steps` is (request, num_cached before the step, rows fed) in the forward's row order."""
        hidden, self.head.target_hidden = self.head.target_hidden, None
        row = 0
        for request, before, fed in steps:
            first, row = row, row + fed
            if request.finished or request.images is not None or hidden is None:
                self.next.pop(request, None)
                continue
            kept = request.num_cached - before
            if kept <= 0:
                continue
            ids = request.prompt_ids + request.output_ids
            tokens = torch.tensor(ids[before + 1:before + kept + 1], dtype=torch.long, device=self.device)
            slots = self.kv_pool.slots(request)[:before + kept].to(self.device)
            out = self.head(self.model.model.embed_tokens(tokens), hidden[first:first + kept], before,
                            self.k_cache, self.v_cache, slots[:before], write_slots=slots[before:before + kept])
            self.next[request] = _Next(request.num_cached, self._logits_token(out[-1]), out[-1])
        for request in [r for r in self.next if r.finished]:
            self.next.pop(request)

    @torch.no_grad()
    def propose(self, request, k: int) -> list[int]:
        """Up to k greedy drafts for the tokens after the request's last one."""
        state = self.next.get(request)
        if state is None or state.cached != request.num_cached or k <= 0:
            return []
        drafts, hidden, chain = [state.token], state.hidden, []
        slots = self.kv_pool.slots(request)[:state.cached].to(self.device)
        embed = self.model.model.embed_tokens
        for j in range(1, k):
            out = self.head(embed(torch.tensor([drafts[-1]], device=self.device)), hidden[None], state.cached + j - 1,
                            self.k_cache, self.v_cache, slots, chain=chain)
            hidden = out[0]
            drafts.append(self._logits_token(hidden))
        return drafts
