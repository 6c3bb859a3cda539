"""The GDN state pool: one fixed slot per running request, holding its conv and recurrent state for every GDN layer.

Slots are allocated once at the count the ledger grants. A request takes a slot when it starts (the slot is
zeroed: GDN layers read their initial state from it) and releases it when it ends. For a model without GDN
layers the pool holds no tensors but still counts slots, so it bounds the running requests the same way.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from deltaserve.cache.kv_pool import PoolCorruption, PoolExhausted
from deltaserve.models.batch import CacheGeometry


class StatePool:
    """`num_slots` state slots; take (zeroed) / release / reset / copy."""

    def __init__(self, geometry: CacheGeometry, num_slots: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError(f"state pool needs at least 1 slot, got {num_slots}")
        self.geometry = geometry
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = torch.device(device)
        n = len(geometry.layer_kinds)
        self.conv: list[torch.Tensor | None] = [None] * n
        self.recurrent: list[torch.Tensor | None] = [None] * n
        g = geometry
        for i in g.gdn_layers:
            self.conv[i] = torch.zeros((num_slots, g.conv_dim, g.conv_width - 1), dtype=dtype, device=self.device)
            self.recurrent[i] = torch.zeros((num_slots, g.num_v_heads, g.key_head_dim, g.value_head_dim),
                                            dtype=dtype, device=self.device)
        self.offset = 0  # where slot 0 lies in the tensors (a view's slots follow its parent's first ones)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[Hashable, int] = {}

    def view(self, first: int, num_slots: int) -> StatePool:
        """A pool of this one's slots first .. first + num_slots - 1, sharing its tensors (and so the per-layer
        tensors a forward writes snapshots into): its slot s is this pool's slot `first + s`. Only the view hands
        those slots out: a parent whose slots are split into views is a storage, not a pool to take from."""
        if first < 0 or num_slots < 1 or first + num_slots > self.num_slots:
            raise ValueError(f"state pool view {first}..{first + num_slots - 1} outside {self.num_slots} slots")
        pool = StatePool.__new__(StatePool)
        pool.geometry, pool.num_slots, pool.dtype, pool.device = self.geometry, num_slots, self.dtype, self.device
        pool.conv = [t[first:first + num_slots] if t is not None else None for t in self.conv]
        pool.recurrent = [t[first:first + num_slots] if t is not None else None for t in self.recurrent]
        pool.offset = self.offset + first
        pool._free = list(range(num_slots - 1, -1, -1))
        pool._slot_of = {}
        return pool

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def bytes(self) -> int:
        """Bytes the conv and recurrent tensors of all GDN layers take."""
        return sum(t.numel() * t.element_size() for t in self.conv + self.recurrent if t is not None)

    def slot(self, owner: Hashable) -> int:
        if owner not in self._slot_of:
            raise PoolCorruption(f"state pool: {owner!r} holds no slot")
        return self._slot_of[owner]

    def holds(self, owner: Hashable) -> bool:
        return owner in self._slot_of

    def take(self, owner: Hashable) -> int:
        """Give the owner a zeroed slot."""
        if owner in self._slot_of:
            raise PoolCorruption(f"state pool: {owner!r} already holds slot {self._slot_of[owner]}")
        if not self._free:
            raise PoolExhausted(f"state pool: all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self.reset(slot)
        self._slot_of[owner] = slot
        return slot

    def transfer(self, owner: Hashable, new_owner: Hashable) -> int:
        """Hand the owner's slot, state untouched, to `new_owner` (which holds none); returns the slot."""
        if new_owner in self._slot_of:
            raise PoolCorruption(f"state pool: {new_owner!r} already holds slot {self._slot_of[new_owner]}")
        slot = self.slot(owner)
        self._slot_of[new_owner] = self._slot_of.pop(owner)
        return slot

    def release(self, owner: Hashable) -> bool:
        """Return the owner's slot to the free list; False when it held none."""
        slot = self._slot_of.pop(owner, None)
        if slot is None:
            return False
        if slot in self._free:
            raise PoolCorruption(f"state pool: slot {slot} released twice")
        self._free.append(slot)
        return True

    def reset(self, slot: int) -> None:
        """Zero one slot's state in every GDN layer."""
        for t in self.conv + self.recurrent:
            if t is not None:
                t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Copy one slot's state onto another (a prefix's state checkpoint, later)."""
        for t in self.conv + self.recurrent:
            if t is not None:
                t[dst].copy_(t[src])

    def copy_into(self, src: int, other: StatePool, dst: int) -> None:
        """Copy one slot's state onto slot `dst` of another pool of the same geometry."""
        for a, b in zip(self.conv + self.recurrent, other.conv + other.recurrent):
            if a is not None:
                b[dst].copy_(a[src])

    def check(self) -> None:
        """Raise PoolCorruption unless free list and owner table partition the slots."""
        held = list(self._slot_of.values())
        every = sorted(held + self._free)
        if every != list(range(self.num_slots)):
            raise PoolCorruption(f"state pool: {len(held)} held + {len(self._free)} free slots "
                                 f"do not partition {self.num_slots}")
