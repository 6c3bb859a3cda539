"""The prefix cache: a radix tree over token ids, one node per full KV page, plus GDN state checkpoints.

Each node holds one page of the KV pool (the node is that page's owner in the pool, so the page's reference
count says who else uses it) and, on a hybrid model, may hold a checkpoint: the conv and recurrent state of every
GDN layer after the node's last token. A GDN state cannot be cut back to a shorter prefix, so a hit on a hybrid
is as deep as the deepest checkpoint on the matched path; a dense model hits as deep as the matched path.

Hits are page-aligned: a request never writes into a shared page, so no page has to be copied on write. A hit
pins its pages by sharing them (their reference count rises); the checkpoint is copied into the request's own
state slot at once, so checkpoints are never pinned. A node is evictable when it is a leaf and the tree is the
only holder of its page; eviction is least recently used first.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable

from deltaserve.cache.kv_pool import KVPool
from deltaserve.cache.state_pool import StatePool


class Node:
    """One full page of tokens under its parent; identity-hashed (it is an owner key in the pools)."""

    __slots__ = ("tokens", "page", "parent", "children", "depth", "last_used", "has_checkpoint")

    def __init__(self, tokens: tuple[int, ...], page: int | None, parent: Node | None, depth: int):
        self.tokens = tokens
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.depth = depth  # tokens from the root to the end of this node
        self.last_used = 0
        self.has_checkpoint = False


class CheckpointPool:
    """`num_slots` GDN state checkpoints, each the state of every GDN layer at one position (its own ledger line)."""

    def __init__(self, states: StatePool):
        self.states = states

    @property
    def num_slots(self) -> int:
        return self.states.num_slots

    @property
    def used_slots(self) -> int:
        return self.states.used_slots

    @property
    def bytes(self) -> int:
        return self.states.bytes

    def save(self, owner: Hashable, live: StatePool, live_slot: int) -> None:
        """Copy a live slot's state into a new checkpoint held by `owner` (the caller made room)."""
        slot = self.states.take(owner)
        _copy_state(live, live_slot, self.states, slot)

    def load(self, owner: Hashable, live: StatePool, live_slot: int) -> None:
        """Copy the owner's checkpoint into a live slot."""
        _copy_state(self.states, self.states.slot(owner), live, live_slot)

    def release(self, owner: Hashable) -> bool:
        return self.states.release(owner)


def _copy_state(src: StatePool, src_slot: int, dst: StatePool, dst_slot: int) -> None:
    for a, b in zip(src.conv + src.recurrent, dst.conv + dst.recurrent):
        if a is not None:
            b[dst_slot].copy_(a[src_slot])


class PrefixCache:
    """The radix tree; `attach` gives a new request its hit, `store` adds a running request's computed prefix."""

    def __init__(self, kv_pool: KVPool, checkpoints: CheckpointPool | None):
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.checkpoints = checkpoints  # None: a dense model, KV alone makes a hit
        self.root = Node((), None, None, 0)
        self._nodes: set[Node] = set()
        self._clock = itertools.count(1)
        self.hit_tokens_total = 0
        self.evicted_pages_total = 0
        self.evicted_checkpoints_total = 0

    @property
    def cached_pages(self) -> int:
        return len(self._nodes)

    def owns(self, owner: Hashable) -> bool:
        return owner in self._nodes

    def evictable_pages(self) -> int:
        """Pages only the tree holds: each can be freed (leaves first) when a request needs room."""
        return sum(1 for n in self._nodes if self.kv_pool.refcount(n.page) == 1)

    # -- lookup -----------------------------------------------------------------------------------------------

    def _path(self, tokens: list[int], limit: int) -> list[Node]:
        """The nodes matching `tokens` from the root, at most `limit` tokens deep."""
        path, node, ps = [], self.root, self.page_size
        for start in range(0, limit - limit % ps, ps):
            node = node.children.get(tuple(tokens[start:start + ps]))
            if node is None:
                break
            path.append(node)
        return path

    def match(self, tokens: list[int], limit: int) -> tuple[int, int]:
        """(hit depth, matched KV depth): how deep a hit goes, and how deep the KV pages alone match."""
        path = self._path(tokens, limit)
        kv_depth = path[-1].depth if path else 0
        if self.checkpoints is None:
            return kv_depth, kv_depth
        hits = [n.depth for n in path if n.has_checkpoint]
        return (hits[-1] if hits else 0), kv_depth

    def attach(self, owner: Hashable, tokens: list[int], limit: int, live: StatePool) -> int:
        """Give `owner` (holding no pages yet) the cached prefix of `tokens`: pages shared, state loaded.

        Returns the hit depth in tokens (0: a miss). `limit` caps the depth (a request must compute at least
        its prompt's last token itself, for the logits).
        """
        depth, _ = self.match(tokens, limit)
        if depth == 0:
            return 0
        path = self._path(tokens, depth)
        now = next(self._clock)
        for node in path:
            node.last_used = now
        self.kv_pool.share(owner, [n.page for n in path])
        if self.checkpoints is not None:
            self.checkpoints.load(path[-1], live, live.slot(owner))
        self.hit_tokens_total += depth
        return depth

    # -- adding -----------------------------------------------------------------------------------------------

    def store(self, owner: Hashable, tokens: list[int], num_tokens: int, live: StatePool | None = None) -> None:
        """Add the full pages of `owner`'s first `num_tokens` tokens; with `live`, checkpoint the state there.

        `live` must hold the owner's state after exactly `num_tokens` tokens (a prefill chunk ended there), and
        `num_tokens` must then be page-aligned.
        """
        ps = self.page_size
        pages = self.kv_pool.pages(owner)
        node, now = self.root, next(self._clock)
        for i in range(num_tokens // ps):
            key = tuple(tokens[i * ps:(i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                child = Node(key, pages[i], node, (i + 1) * ps)
                self.kv_pool.share(child, [pages[i]])
                node.children[key] = child
                self._nodes.add(child)
            child.last_used = now
            node = child
        if (live is not None and self.checkpoints is not None and node is not self.root
                and node.depth == num_tokens and not node.has_checkpoint):
            if self.checkpoints.states.free_slots == 0 and not self._evict_checkpoint():
                return
            self.checkpoints.save(node, live, live.slot(owner))
            node.has_checkpoint = True

    # -- eviction ---------------------------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages the tree alone holds, least recently used leaves first; returns freed."""
        freed = 0
        while freed < num_pages:
            leaves = sorted((n for n in self._nodes if not n.children and self.kv_pool.refcount(n.page) == 1),
                            key=lambda n: n.last_used)
            if not leaves:
                break
            for node in leaves[:num_pages - freed]:
                self._remove(node)
                freed += 1
        self.evicted_pages_total += freed
        return freed

    def _evict_checkpoint(self) -> bool:
        """Drop the least recently used checkpoint; False when there is none."""
        held = [n for n in self._nodes if n.has_checkpoint]
        if not held:
            return False
        victim = min(held, key=lambda n: n.last_used)
        self.checkpoints.release(victim)
        victim.has_checkpoint = False
        self.evicted_checkpoints_total += 1
        return True

    def _remove(self, node: Node) -> None:
        if node.has_checkpoint:
            self.checkpoints.release(node)
            node.has_checkpoint = False
        self.kv_pool.free(node)
        del node.parent.children[node.tokens]
        self._nodes.discard(node)

    def flush(self) -> int:
        """Drop every page and checkpoint no running request uses; returns the pages freed."""
        freed = self.evict(len(self._nodes))
        for node in list(self._nodes):
            if node.has_checkpoint:
                self.checkpoints.release(node)
                node.has_checkpoint = False
        return freed

    def check(self) -> None:
        """Raise AssertionError unless every node holds exactly its one page and the checkpoints agree."""
        for node in self._nodes:
            assert self.kv_pool.pages(node) == [node.page], f"node at depth {node.depth} holds the wrong pages"
            assert node.parent.children.get(node.tokens) is node, "node detached from its parent"
            if self.checkpoints is not None:
                assert node.has_checkpoint == self.checkpoints.states.holds(node), "checkpoint flag disagrees"
        if self.checkpoints is not None:
            assert self.checkpoints.used_slots == sum(n.has_checkpoint for n in self._nodes), "checkpoint leaked"
