"""The contract between the engine and the models: one packed batch, and the caches it reads and writes.

The engine (engine/runner.py) builds a `ForwardBatch` per step; the pools (cache/) own the tensors in
`ModelCaches`; a model's `forward(batch, caches)` reads and writes those caches in place and returns the logits
of the rows the sampler needs. Sequences are ordered decode-first: the first `num_decode` sequences contribute one
token each and already have context in the caches; the rest are prefill chunks (a fresh prompt or the next chunk of
a long one), packed one after another.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

ATTENTION = "attention"
GDN = "gdn"


@dataclass(frozen=True)
class CacheGeometry:
    """What one request needs per layer: KV rows for attention layers, a fixed state for GDN layers."""

    layer_kinds: tuple[str, ...]  # ATTENTION or GDN, one per decoder layer
    num_kv_heads: int = 0
    head_dim: int = 0
    conv_dim: int = 0  # channels of the GDN causal conv (q, k and v concatenated)
    conv_width: int = 0  # kernel width W; the conv state keeps the last W - 1 inputs
    num_v_heads: int = 0  # GDN recurrent state is [num_v_heads, key_head_dim, value_head_dim]
    key_head_dim: int = 0
    value_head_dim: int = 0

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind == ATTENTION]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind == GDN]


@dataclass
class ModelCaches:
    """Per-layer views of the pools; entries are None for layers of the other kind.

    k[i], v[i]: [kv_slots, num_kv_heads, head_dim] where a flat slot is page * page_size + offset.
    conv[i]: [state_slots, conv_dim, conv_width - 1]; recurrent[i]: [state_slots, num_v_heads, Dk, Dv].
    """

    k: list[torch.Tensor | None]
    v: list[torch.Tensor | None]
    conv: list[torch.Tensor | None]
    recurrent: list[torch.Tensor | None]
    # Where ForwardBatch.snapshots write (the prefix cache's checkpoint pool): the same shapes as conv and
    # recurrent, indexed by checkpoint slot; None without a checkpoint pool.
    snapshot_conv: list[torch.Tensor | None] | None = None
    snapshot_recurrent: list[torch.Tensor | None] | None = None


@dataclass
class ForwardBatch:
    """One model step over B sequences whose new tokens are packed into T rows."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    q_lens: list[int]  # [B] new tokens per sequence
    cached_lens: list[int]  # [B] tokens of each sequence already in the caches before this step
    num_decode: int  # the first num_decode sequences have q_len 1 and cached_len > 0
    cu_q: torch.Tensor  # [B + 1] int64 offsets of each sequence's rows in the packed tokens
    slot_mapping: torch.Tensor  # [T] int64 flat KV slot where each new token's K/V is written
    context_slots: torch.Tensor  # [B, max_context] int64 flat KV slots of each sequence's whole context, padded
    state_slots: torch.Tensor  # [B] int64 GDN state slot of each sequence
    logits_indices: torch.Tensor  # [R] int64 rows of the packed tokens whose logits are returned
    # Decode rows may use a paged fast path (CPU: kernels/paged_cpu.py, once built); False: --attention-backend
    # portable, gather + SDPA whatever else the process has loaded.
    paged_kernel: bool = True
    # Images (models with a vision tower): rows of the packed tokens that are image tokens, and the tower's
    # embeddings that replace their token embeddings; and the multimodal rotary positions [3, T] (time, row,
    # column) where any sequence of the batch holds an image. `positions` stays each token's index in its sequence.
    image_rows: torch.Tensor | None = None  # [K] int64
    image_embeds: torch.Tensor | None = None  # [K, hidden]
    rope_positions: torch.Tensor | None = None  # [3, T] int64
    # GDN states to keep from the middle of a prefill chunk: (sequence index, tokens of its chunk read, slot in
    # caches.snapshot_conv / snapshot_recurrent), 0 < tokens < q_len, rising tokens within a sequence
    snapshots: tuple[tuple[int, int, int], ...] = ()
    # A batch of decode rows made from chunks (as_decode_rows): per row, the slot in caches.snapshot_conv /
    # snapshot_recurrent its GDN state goes to after it, or -1; None: no row keeps one
    row_snapshots: torch.Tensor | None = None  # [T] int64
    # out: [R] int64, each logits row's argmax, where the model's head ran in the step's one native call (the
    # sampler's greedy tokens without its own pass over the logits)
    logits_argmax: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def context_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.cached_lens, self.q_lens)]

    @property
    def last_layer_rows(self) -> torch.Tensor | None:
        """The rows a model's last layer computes past its token mixer's cache writes, or None for every row.

        Only the logits rows matter there: when those are at most one per sequence (a prefill's last token), its
        queries, attention and MLP run for them alone. A prefill chunk of one token is pruned too: as a decode row
        its attention reads the pages in place instead of gathering its whole context."""
        rows = self.logits_indices
        fewer = len(rows) < len(self.input_ids) or self.num_decode < self.num_seqs
        return rows if len(rows) <= self.num_seqs and fewer else None

    @cached_property
    def decode_context_lens(self) -> torch.Tensor:
        """[num_decode] int64 context lengths of the decode sequences, built once per step for every layer."""
        return torch.tensor(self.context_lens[: self.num_decode], dtype=torch.long)


def rows_as_decode(batch: ForwardBatch, rows: torch.Tensor) -> ForwardBatch:
    """The chosen rows of a batch as single-token queries, each over its own sequence's context up to itself."""
    seq = torch.searchsorted(batch.cu_q, rows, right=True) - 1
    positions = batch.positions[rows]
    return ForwardBatch(
        input_ids=batch.input_ids[rows], positions=positions, q_lens=[1] * len(rows),
        cached_lens=positions.tolist(), num_decode=len(rows), cu_q=torch.arange(len(rows) + 1),
        slot_mapping=batch.slot_mapping[rows], context_slots=batch.context_slots[seq],
        state_slots=batch.state_slots[seq], logits_indices=torch.arange(len(rows)), paged_kernel=batch.paged_kernel,
    )


DECODE_ROWS_CHUNK = 9  # the longest chunk run as decode rows: a verifying request's 1 + k rows (k <= 8)


def as_decode_rows(batch: ForwardBatch, max_rows: int) -> ForwardBatch | None:
    """The step as decode rows only, for the native decode path (kernels/decode_cpu.py), or None where it cannot be.

    A decode-only batch is itself. A step with short chunks (a verifying request's [last, d1..dk], engine/
    speculative.py) becomes one decode row per packed row: row j of a chunk at position L + j, over its sequence's
    context up to itself (length L + j + 1, the sequence's page table). The attention block writes every row's K/V
    before any row attends, so each row sees the chunk's earlier rows: causal attention within the chunk. Rows of
    one sequence share its GDN state slot and follow each other (gdn_block chains them, in order); a snapshot asked
    for after `read` rows of a chunk becomes that row's `row_snapshots` entry. None: images, more than `max_rows`
    rows, or a chunk longer than DECODE_ROWS_CHUNK (a prompt's chunk is a prefill's work)."""
    if batch.num_decode == batch.num_seqs:
        return batch
    total = batch.input_ids.shape[0]
    if (batch.image_rows is not None or batch.rope_positions is not None or total > max_rows
            or max(batch.q_lens) > DECODE_ROWS_CHUNK):
        return None
    rows = rows_as_decode(batch, torch.arange(total, device=batch.input_ids.device))
    if batch.snapshots:
        snaps = torch.full((total,), -1, dtype=torch.long)
        starts = batch.cu_q.tolist()
        for b, read, slot in batch.snapshots:
            snaps[starts[b] + read - 1] = slot
        rows.row_snapshots = snaps.to(batch.input_ids.device)
    return rows


def single_sequence_batch(
    input_ids: list[int], cached_len: int, slots: torch.Tensor, state_slot: int = 0, all_logits: bool = False,
    **images,
) -> ForwardBatch:
    """A batch of one sequence whose context occupies `slots[: cached_len + len(input_ids)]`.

    Used by tests and by simple callers that keep one request in contiguous slots; `images` are ForwardBatch's
    image_rows, image_embeds and rope_positions.
    """
    q_len = len(input_ids)
    total = cached_len + q_len
    ids = torch.tensor(input_ids, dtype=torch.long)
    rows = torch.arange(q_len) if all_logits else torch.tensor([q_len - 1])
    return ForwardBatch(
        input_ids=ids,
        positions=torch.arange(cached_len, total, dtype=torch.long),
        q_lens=[q_len],
        cached_lens=[cached_len],
        num_decode=1 if (q_len == 1 and cached_len > 0) else 0,
        cu_q=torch.tensor([0, q_len], dtype=torch.long),
        slot_mapping=slots[cached_len:total].long(),
        context_slots=slots[:total].long().unsqueeze(0),
        state_slots=torch.tensor([state_slot], dtype=torch.long),
        logits_indices=rows,
        **images,
    )


def allocate_caches(
    geometry: CacheGeometry, kv_slots: int, state_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu",
    state_dtype: torch.dtype = torch.float32,
) -> ModelCaches:
    """Plain contiguous caches for tests and one-off runs; the engine uses cache/ pools instead."""
    n = len(geometry.layer_kinds)
    caches = ModelCaches(k=[None] * n, v=[None] * n, conv=[None] * n, recurrent=[None] * n)
    for i in geometry.attention_layers:
        shape = (kv_slots, geometry.num_kv_heads, geometry.head_dim)
        caches.k[i] = torch.zeros(shape, dtype=dtype, device=device)
        caches.v[i] = torch.zeros(shape, dtype=dtype, device=device)
    for i in geometry.gdn_layers:
        caches.conv[i] = torch.zeros(
            (state_slots, geometry.conv_dim, geometry.conv_width - 1), dtype=state_dtype, device=device
        )
        caches.recurrent[i] = torch.zeros(
            (state_slots, geometry.num_v_heads, geometry.key_head_dim, geometry.value_head_dim),
            dtype=state_dtype, device=device,
        )
    return caches
