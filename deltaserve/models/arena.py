"""A loaded model's weights moved into one buffer backed by 2 MB pages (CPU): what a decode step streams, in order.

A decode step reads every weight once, layer after layer. Held as the loader made them, they are hundreds of separate
allocations in 4 KB pages: the step's ~100 MB of SmolLM2 cross ~24,000 pages, a page-table walk each, and each
projection starts a new stream. Moved into one anonymous mapping that asks the kernel for transparent huge pages
(madvise MADV_HUGEPAGE: Linux's THP in its default `madvise` mode), in the order the modules hold them (a layer's
projections after one another, layer after layer), the same bytes read faster (the timings:
bench/results/2026-12-07T1900Z-lab-notes-engine-models.json). It is what llama.cpp's one mapped file gives its
weights, with the pages llama.cpp does not ask for.

The values are the same tensors' bytes, copied once at load: every parameter and buffer becomes a view of the buffer
(a tensor two modules share, as a tied head's codes, stays one view), so the ledger's weights line and the engine's
measured bytes are unchanged; each original is freed as soon as its copy is made (its pages given back every
RELEASE_EVERY bytes), so the move holds at most that much beyond the weights, never twice them. The kernels'
argument caches built from the old tensors (FusedParts, FusedHead, decode_cpu.Stack, DecodeStackPath) are
forgotten first and rebuilt at the next step.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

from deltaserve.kernels import decode_cpu
from deltaserve.models.decode_stack_path import DecodeStackPath
from deltaserve.models.layers import FusedHead, FusedParts, Int4Embedding, Int8Embedding, PanelEmbedding

EMBEDDINGS = (nn.Embedding, Int4Embedding, Int8Embedding, PanelEmbedding)  # a step reads one row of their tables
HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line


def huge_pages_available() -> bool:
    """Whether this platform can ask for transparent huge pages on an anonymous mapping (Linux, Python's mmap)."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], untouched, starting on a 2 MB boundary of a private anonymous mapping that asks for transparent
    huge pages (a shared mapping would be shmem, whose huge pages a separate setting governs); each page is made when
    first written. The tensor keeps the mapping alive. Only where huge_pages_available()."""
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(area, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start: start + nbytes]


RELEASE_EVERY = 32 << 20  # bytes of originals freed between two calls of `release`


def pack_weights(model: nn.Module, release=None) -> int:
    """Move every contiguous CPU parameter and buffer of `model` into one buffer (module docstring); returns the bytes
    moved (0: nothing moved, where this platform has no huge pages to ask for or the model holds nothing on CPU).
    `release()`, called after every RELEASE_EVERY bytes of originals freed, gives their pages back to the OS (the
    allocator keeps a freed heap chunk otherwise, and the load would peak at twice the weights)."""
    if not huge_pages_available():
        return 0
    sizes: dict[tuple, int] = {}  # one entry per distinct tensor: its key -> bytes (no reference kept to it)
    for _, store, name in _slots(model):
        t = store[name]
        sizes.setdefault(_key(t), t.numel() * t.element_size())
    total = sum(-(-n // ALIGN) * ALIGN for n in sizes.values())
    if total == 0:
        return 0
    for module in model.modules():  # the argument caches hold the old tensors: rebuilt from the views
        for value in vars(module).values():
            if isinstance(value, (FusedParts, FusedHead, decode_cpu.Stack, DecodeStackPath)):
                value.forget()
    whole = huge_page_buffer(total)
    views: dict[tuple, torch.Tensor] = {}
    used = freed = 0
    for module, store, name in _slots(model):
        t = store[name]
        key = _key(t)
        view = views.get(key)
        if view is None:
            n = sizes[key]
            view = whole[used: used + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            views[key] = view
            used += -(-n // ALIGN) * ALIGN
            freed += n
        store[name] = nn.Parameter(view, requires_grad=False) if isinstance(t, nn.Parameter) else view
        del t  # the original goes as soon as no module holds it
        if release is not None and freed >= RELEASE_EVERY:
            release()
            freed = 0
    if release is not None:
        release()
    return used


def _slots(model: nn.Module):
    """(module, its parameter or buffer dict, name) of every tensor the buffer takes: on CPU, contiguous, not empty,
    in the order the modules hold them (a step reads them in that order); not an embedding table no other module
    reads (a step reads one row of it: where the loader left it file-backed, most of it never becomes resident, and a
    copy would make all of it so)."""
    read_whole = {_key(t) for module in model.modules() if not isinstance(module, EMBEDDINGS)
                  for store in (module._parameters, module._buffers) for t in store.values() if t is not None}
    for module in model.modules():
        embedding = isinstance(module, EMBEDDINGS)
        for store in (module._parameters, module._buffers):
            for name in list(store):
                t = store[name]
                if (t is not None and t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0
                        and (not embedding or _key(t) in read_whole)):
                    yield module, store, name


def _key(t: torch.Tensor) -> tuple:
    """What makes two references the same tensor's bytes: one view for both."""
    return t.data_ptr(), t.dtype, tuple(t.shape)
