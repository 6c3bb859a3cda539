"""The KV cache of the attention layers: fixed-size pages, allocated once at the size the ledger grants.

A flat KV slot is `page * page_size + offset`; every attention layer has a K and a V tensor of
[num_pages * page_size, num_kv_heads, head_dim]. Pages are handed to owners (requests) from a free list and
carry reference counts, so a page shared by several owners (a cached prefix, later) is freed by its last one.
Each owner's flat slots are kept as one int64 tensor that grows a page at a time, so building a batch never
walks a context token by token in Python.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from deltaserve.models.batch import CacheGeometry


class PoolExhausted(RuntimeError):
    """More pages were asked for than are free."""


class PoolCorruption(RuntimeError):
    """A page was freed that is not held (a double free), or an owner is unknown."""


class KVPool:
    """Pages of `page_size` tokens for every attention layer; a free list, refcounts and owner -> pages."""

    def __init__(self, geometry: CacheGeometry, num_pages: int, page_size: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if page_size < 1 or num_pages < 0:
            raise ValueError(f"KV pool needs page_size >= 1 and num_pages >= 0, got {page_size} and {num_pages}")
        self.geometry = geometry
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        n = len(geometry.layer_kinds)
        self.k: list[torch.Tensor | None] = [None] * n
        self.v: list[torch.Tensor | None] = [None] * n
        shape = (num_pages * page_size, geometry.num_kv_heads, geometry.head_dim)
        for i in geometry.attention_layers:
            self.k[i] = torch.zeros(shape, dtype=dtype, device=self.device)
            self.v[i] = torch.zeros(shape, dtype=dtype, device=self.device)
        # Popped from the end: lowest page ids first, which keeps small runs cache-friendly.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refcount = [0] * num_pages
        self._pages: dict[Hashable, list[int]] = {}
        self._slots: dict[Hashable, torch.Tensor] = {}
        self._offsets = torch.arange(page_size, dtype=torch.long)

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def bytes(self) -> int:
        """Bytes the K and V tensors of all attention layers take."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def owners(self) -> list[Hashable]:
        return list(self._pages)

    def pages(self, owner: Hashable) -> list[int]:
        """The pages an owner holds, in context order (empty when it holds none)."""
        return list(self._pages.get(owner, ()))

    def capacity(self, owner: Hashable) -> int:
        """Tokens the owner's pages can hold."""
        return len(self._pages.get(owner, ())) * self.page_size

    def slots(self, owner: Hashable) -> torch.Tensor:
        """Flat slots of all the owner's pages, [capacity(owner)] int64."""
        slots = self._slots.get(owner)  # (a default argument would slice a tensor on every call: a decode step's)
        return slots if slots is not None else self._offsets[:0]

    def allocate(self, owner: Hashable, num_pages: int) -> list[int]:
        """Append `num_pages` free pages to the owner's table; all or nothing."""
        if num_pages > len(self._free):
            raise PoolExhausted(f"KV pool: {num_pages} pages asked for, {len(self._free)} of {self.num_pages} free")
        new = [self._free.pop() for _ in range(num_pages)]
        for page in new:
            self._refcount[page] = 1
        self._extend(owner, new)
        return new

    def ensure(self, owner: Hashable, num_tokens: int) -> None:
        """Grow the owner's pages (lazily, a page at a time) until they hold `num_tokens` tokens."""
        missing = self.pages_for(num_tokens) - len(self._pages.get(owner, ()))
        if missing > 0:
            self.allocate(owner, missing)

    def share(self, owner: Hashable, pages: list[int], *, with_slots: bool = True) -> None:
        """Append pages another owner holds to this owner's table (a shared prefix); raises their refcounts.

        `with_slots` False: an owner that only holds the pages (a prefix-cache node) and never reads `slots`."""
        for page in pages:
            if self._refcount[page] <= 0:
                raise PoolCorruption(f"KV pool: page {page} is free and cannot be shared")
        for page in pages:
            self._refcount[page] += 1
        if with_slots:
            self._extend(owner, list(pages))
        else:
            self._pages.setdefault(owner, []).extend(pages)

    def free(self, owner: Hashable) -> int:
        """Drop the owner's pages; a page returns to the free list when its last owner lets go.

        Returns how many pages became free. Freeing an owner that holds nothing is a no-op.
        """
        pages = self._pages.pop(owner, None)
        self._slots.pop(owner, None)
        if pages is None:
            return 0
        released = 0
        for page in pages:
            if self._refcount[page] <= 0:
                raise PoolCorruption(f"KV pool: page {page} freed twice")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free.append(page)
                released += 1
        return released

    def copy_tokens(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        """Copy the K and V of the first `num_tokens` tokens of one page onto another (a shared page's copy on
        write), in every attention layer."""
        ps = self.page_size
        src, dst = slice(src_page * ps, src_page * ps + num_tokens), slice(dst_page * ps, dst_page * ps + num_tokens)
        for t in self.k + self.v:
            if t is not None:
                t[dst].copy_(t[src])

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def check(self) -> None:
        """Raise PoolCorruption unless free list, refcounts and owner tables agree."""
        held: dict[int, int] = {}
        for pages in self._pages.values():
            for page in pages:
                held[page] = held.get(page, 0) + 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise PoolCorruption("KV pool: a page is on the free list twice")
        for page in range(self.num_pages):
            count = held.get(page, 0)
            if count != self._refcount[page] or (count == 0) != (page in free):
                raise PoolCorruption(f"KV pool: page {page} has refcount {self._refcount[page]}, "
                                     f"{count} holders, {'free' if page in free else 'not free'}")

    def _extend(self, owner: Hashable, new: list[int]) -> None:
        self._pages.setdefault(owner, []).extend(new)
        page_ids = torch.tensor(new, dtype=torch.long)
        new_slots = (page_ids.unsqueeze(1) * self.page_size + self._offsets).reshape(-1)
        old = self._slots.get(owner)
        self._slots[owner] = new_slots if old is None else torch.cat([old, new_slots])
