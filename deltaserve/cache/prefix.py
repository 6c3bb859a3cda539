"""The prefix cache: a radix tree over token ids, one node per KV page, plus GDN state checkpoints.

A full node holds one whole page of the KV pool (the node is an owner of that page in the pool, so the page's
reference count says who else uses it). Under each full node (and the root) hang partial nodes: fewer than a
page of tokens, in a page whose first tokens are valid (the page may be a running request's, which writes only
past them). On a hybrid model a node may hold a checkpoint: the conv and recurrent state of every GDN layer after
its last token. A GDN state cannot be cut back to a shorter prefix, so a hit on a hybrid is as deep as the deepest
checkpoint on the matched path (at any token, through a partial node); a dense model hits as deep as any stored
page matches, to the token.

A hit shares the whole pages it uses (their reference count rises, which pins them) and copies the last partial
page on write: the matched tokens' K and V go into a page of the request's own, so no request writes into a page
it shares. The checkpoint is copied into the request's state slot at once, so checkpoints are never pinned.

Eviction frees pages only the tree holds, leaves first, and drops checkpoints when their pool is full. "marconi"
(Marconi, MLSys 2025) weighs recency with the compute a hit saves per byte (the prefix's tokens, for one page or
one checkpoint of fixed size) and drops first the hybrid pages no checkpoint makes reachable; "lru" is plain
least recently used. bench/prefix_cache.py --eviction compares them.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from deltaserve.cache.kv_pool import KVPool, PoolExhausted
from deltaserve.cache.state_pool import StatePool

EVICTION_POLICIES = ("marconi", "lru")
MARCONI_ALPHA = 1.0  # weight of compute saved per byte against recency (both scaled to [0, 1])


class Node:
    """Tokens of one page under its parent (a whole page, or fewer in a partial node); identity-hashed (it is an
    owner key in the pools)."""

    __slots__ = ("tokens", "page", "parent", "children", "partials", "depth", "last_used", "has_checkpoint", "serial")

    def __init__(self, tokens: tuple[int, ...], page: int | None, parent: Node | None, depth: int, serial: int = 0):
        self.tokens = tokens
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}  # full pages
        self.partials: dict[tuple[int, ...], Node] = {}  # fewer tokens than a page (never with children)
        self.depth = depth  # tokens from the root to the end of this node
        self.last_used = 0
        self.has_checkpoint = False
        self.serial = serial  # creation order: breaks ties, so eviction does not depend on memory addresses

    @property
    def is_leaf(self) -> bool:
        return not self.children and not self.partials

    def all_children(self) -> Iterable[Node]:
        return itertools.chain(self.children.values(), self.partials.values())


@dataclass
class Hit:
    """What a request takes from the tree: `depth` tokens, as shared whole pages plus `copy_tokens` copied from
    `copy_from`'s page, and (hybrid) the checkpoint of `checkpoint` loaded into its state slot."""

    depth: int = 0
    shared: list[Node] = field(default_factory=list)
    copy_from: Node | None = None
    copy_tokens: int = 0
    checkpoint: Node | None = None


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

    @property
    def bytes_per_checkpoint(self) -> int:
        return self.states.bytes // max(self.states.num_slots, 1)

    def save(self, owner: Hashable, live: StatePool, live_slot: int) -> None:
        """Copy a live slot's state into a new checkpoint held by `owner` (the caller made room)."""
        slot = self.states.take(owner)
        _copy_state(live, live_slot, self.states, slot)

    def adopt(self, snapshot: Hashable, owner: Hashable) -> None:
        """Make a reserved slot, into which a forward wrote the state (a snapshot), the checkpoint of `owner`."""
        self.states.transfer(snapshot, owner)

    def load(self, owner: Hashable, live: StatePool, live_slot: int) -> None:
        """Copy the owner's checkpoint into a live slot."""
        _copy_state(self.states, self.states.slot(owner), live, live_slot)

    def release(self, owner: Hashable) -> bool:
        return self.states.release(owner)


def _copy_state(src: StatePool, src_slot: int, dst: StatePool, dst_slot: int) -> None:
    for a, b in zip(src.conv + src.recurrent, dst.conv + dst.recurrent):
        if a is not None:
            b[dst_slot].copy_(a[src_slot])


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """The radix tree; `attach` gives a new request its hit, `store` adds a running request's computed prefix."""

    def __init__(self, kv_pool: KVPool, checkpoints: CheckpointPool | None, eviction: str = "marconi"):
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction {eviction!r}: one of {', '.join(EVICTION_POLICIES)}")
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.checkpoints = checkpoints  # None: a dense model, KV alone makes a hit
        self.eviction = eviction
        self.root = Node((), None, None, 0)
        self._nodes: set[Node] = set()
        self._holders: dict[int, int] = {}  # page -> tree nodes holding it (a partial node may share a full one's)
        self._clock = itertools.count(1)
        # owner -> the deepest whole-page node its last store reached: a running request's next store goes on from
        # there instead of hashing its whole prefix again, page by page (at 11K tokens: ~1 ms a store)
        self._frontier: dict[Hashable, Node] = {}
        self.hit_tokens_total = 0
        self.evicted_pages_total = 0
        self.evicted_checkpoints_total = 0

    @property
    def cached_pages(self) -> int:
        """Distinct pages the tree holds."""
        return len(self._holders)

    def owns(self, owner: Hashable) -> bool:
        return owner in self._nodes

    def evictable_pages(self) -> int:
        """Pages only the tree holds: each can be freed (leaves first) when a request needs room."""
        return sum(1 for page, n in self._holders.items() if self.kv_pool.refcount(page) == n)

    # -- lookup -----------------------------------------------------------------------------------------------

    def _path(self, tokens: list[int], limit: int) -> list[Node]:
        """The full nodes matching `tokens` from the root, at most `limit` tokens deep."""
        path, node, ps = [], self.root, self.page_size
        for start in range(0, limit - limit % ps, ps):
            node = node.children.get(tuple(tokens[start:start + ps]))
            if node is None:
                break
            path.append(node)
        return path

    def lookup(self, tokens: list[int], limit: int) -> tuple[Hit, int]:
        """(the hit for `tokens` at most `limit` deep, how deep the stored KV alone matches them)."""
        path = self._path(tokens, limit)
        last = path[-1] if path else self.root
        rest = tokens[last.depth:min(limit, last.depth + self.page_size)]
        best, source = 0, None
        for child in last.all_children():  # a page whose first tokens match beyond the whole pages
            n = _common(child.tokens, rest)
            if n > best:
                best, source = n, child
        kv_depth = last.depth + best
        if self.checkpoints is None:
            return Hit(kv_depth, path, source, best), kv_depth
        hit = Hit()
        for i, node in enumerate([self.root] + path):
            if node.has_checkpoint:
                hit = Hit(node.depth, path[:i], checkpoint=node)
            for part in node.partials.values():
                end = node.depth + len(part.tokens)
                if (part.has_checkpoint and hit.depth < end <= limit
                        and tuple(tokens[node.depth:end]) == part.tokens):
                    hit = Hit(end, path[:i], part, len(part.tokens), part)
        return hit, kv_depth

    def attach(self, owner: Hashable, hit: Hit, live: StatePool) -> int:
        """Give `owner` (holding no pages yet) the hit: whole pages shared, the partial page copied, the state
        loaded. Returns the tokens taken (0 when the copy found no page: then nothing was taken)."""
        if hit.depth == 0:
            return 0
        now = next(self._clock)
        self.kv_pool.share(owner, [n.page for n in hit.shared])
        if hit.copy_tokens:
            pin = (self, owner)  # the source page must outlive the eviction that makes room for its copy
            self.kv_pool.share(pin, [hit.copy_from.page])
            try:
                if self.kv_pool.free_pages == 0:
                    self.evict(1)
                page = self.kv_pool.allocate(owner, 1)[0]
                self.kv_pool.copy_tokens(hit.copy_from.page, page, hit.copy_tokens)
            except PoolExhausted:
                self.kv_pool.free(owner)
                return 0
            finally:
                self.kv_pool.free(pin)
        for node in hit.shared + [n for n in (hit.copy_from, hit.checkpoint) if n is not None]:
            node.last_used = now
        if hit.checkpoint is not None:
            self.checkpoints.load(hit.checkpoint, live, live.slot(owner))
        self.hit_tokens_total += hit.depth
        return hit.depth

    # -- adding -----------------------------------------------------------------------------------------------

    def reserve_checkpoint(self, snapshot: Hashable) -> int | None:
        """A checkpoint slot held by `snapshot` (a key of the caller's) for a forward to write a state into, in
        the middle of a prefill chunk; None when every checkpoint is in use and none can be dropped. `store`
        with the same key makes it a node's checkpoint; `release_reserved` frees one store did not take."""
        if self.checkpoints is None:
            return None
        if self.checkpoints.states.free_slots == 0 and not self._evict_checkpoint(keep=None):
            return None
        return self.checkpoints.states.take(snapshot)

    def release_reserved(self, snapshot: Hashable) -> None:
        self.checkpoints.release(snapshot)

    def store(self, owner: Hashable, tokens: list[int], num_tokens: int, live: StatePool | None = None,
              snapshot: Hashable | None = None) -> None:
        """Add the pages of `owner`'s first `num_tokens` tokens; with `live` or `snapshot`, checkpoint the state
        there.

        `live` must hold the owner's state after exactly `num_tokens` tokens (a prefill chunk ended there);
        `snapshot` is a slot from `reserve_checkpoint` that holds it (written in the middle of a chunk): it becomes
        the checkpoint, or is released. On a hybrid a partial page is stored only with its checkpoint (without one
        no hit can end in it).
        """
        try:
            self._store(owner, tokens, num_tokens, live, snapshot)
        finally:
            if snapshot is not None and self.checkpoints.states.holds(snapshot):
                self.checkpoints.release(snapshot)

    def _store(self, owner, tokens, num_tokens, live, snapshot) -> None:
        ps = self.page_size
        pages = self.kv_pool.pages(owner)
        node, now = self.root, next(self._clock)
        front = self._frontier.get(owner)
        if front is not None and front in self._nodes and front.depth <= num_tokens:
            node = front  # still in the tree, so its path from the root is still the owner's prefix
            while front is not self.root:
                front.last_used, front = now, front.parent
        for i in range(node.depth // ps, num_tokens // ps):
            key = tuple(tokens[i * ps:(i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                child = self._add(node, key, pages[i], (i + 1) * ps)
                self._drop_covered_partials(node, key)
            child.last_used = now
            node = child
        if node is not self.root:
            self._frontier[owner] = node
        rest = num_tokens % ps
        checkpoint = (live is not None or snapshot is not None) and self.checkpoints is not None
        if rest and (checkpoint or self.checkpoints is None):
            key = tuple(tokens[num_tokens - rest:num_tokens])
            if self.checkpoints is None:
                covering = next((c for c in node.all_children() if c.tokens[:rest] == key), None)
                if covering is not None:  # a dense page that starts with these tokens is stored already
                    covering.last_used = now
                    return
            part = node.partials.get(key)
            if part is None:
                self._drop_covered_partials(node, key)
                part = self._add(node, key, pages[num_tokens // ps], num_tokens)
            part.last_used = now
            node = part
        if checkpoint and node is not self.root and node.depth == num_tokens and not node.has_checkpoint:
            if snapshot is not None:
                self.checkpoints.adopt(snapshot, node)
            else:
                if self.checkpoints.states.free_slots == 0 and not self._evict_checkpoint(keep=node):
                    return
                self.checkpoints.save(node, live, live.slot(owner))
            node.has_checkpoint = True

    def forget(self, owner: Hashable) -> None:
        """The owner (a request) has ended: its next store, if any, walks from the root."""
        self._frontier.pop(owner, None)

    def _add(self, parent: Node, key: tuple[int, ...], page: int, depth: int) -> Node:
        node = Node(key, page, parent, depth, next(self._clock))
        self.kv_pool.share(node, [page], with_slots=False)
        self._holders[page] = self._holders.get(page, 0) + 1
        (parent.children if len(key) == self.page_size else parent.partials)[key] = node
        self._nodes.add(node)
        return node

    def _drop_covered_partials(self, parent: Node, key: tuple[int, ...]) -> None:
        """Partial nodes without a checkpoint that `key` extends add nothing: drop them."""
        for part in [p for p in parent.partials.values() if not p.has_checkpoint and key[:len(p.tokens)] == p.tokens
                     and len(p.tokens) < len(key)]:
            self._remove(part)

    # -- eviction ---------------------------------------------------------------------------------------------

    def _evictable(self, node: Node) -> bool:
        return node.is_leaf and self.kv_pool.refcount(node.page) == self._holders[node.page]

    def _order(self, candidates: list[Node], useless=lambda node: False) -> list[Node]:
        """Candidates in eviction order: least recently used first ("lru"), or (Marconi) useless ones first (by
        recency), then by recency plus compute saved per byte, both scaled to [0, 1] over the candidates."""
        if self.eviction == "lru":  # among equally recent nodes, the deepest (a prompt's tail) first
            return sorted(candidates, key=lambda n: (n.last_used, -n.depth, n.serial))
        lo = min(n.last_used for n in candidates)
        span = max(max(n.last_used for n in candidates) - lo, 1)
        deepest = max(max(n.depth for n in candidates), 1)

        def score(n: Node) -> float:
            recency = (n.last_used - lo) / span
            # one page or one checkpoint has a fixed size: the compute a hit saves per byte goes as the prefix's
            # tokens
            return recency - 2.0 if useless(n) else recency + MARCONI_ALPHA * n.depth / deepest

        return sorted(candidates, key=lambda n: (score(n), n.serial))

    def _shadowed(self, node: Node) -> bool:
        """Whether a deeper checkpoint lies below `node` with no branch between: every hit through `node` that
        goes on down that path takes the deeper one, so this one only serves a prompt that diverges in between
        (Marconi keeps states where the tree branches)."""
        while len(node.children) + len(node.partials) == 1:
            node = next(node.all_children())
            if node.has_checkpoint:
                return True
        return False

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages the tree alone holds, leaves first; returns how many were freed."""
        freed = 0
        hybrid = self.checkpoints is not None
        while freed < num_pages:
            leaves = [n for n in self._nodes if self._evictable(n)]
            if not leaves:
                break
            # a hybrid page past the last checkpoint of its branch can never be part of a hit
            order = self._order(leaves, useless=lambda n: hybrid and not n.has_checkpoint)
            for node in order[:num_pages - freed]:
                freed += self._remove(node)
        self.evicted_pages_total += freed
        return freed

    def _evict_checkpoint(self, keep: Node) -> bool:
        """Drop one checkpoint (a partial node goes with it); False when there is none to drop."""
        held = [n for n in self._nodes if n.has_checkpoint and n is not keep]
        if not held:
            return False
        victim = self._order(held, useless=self._shadowed)[0]
        self.checkpoints.release(victim)
        victim.has_checkpoint = False
        self.evicted_checkpoints_total += 1
        if len(victim.tokens) < self.page_size:
            self._remove(victim)
        return True

    def _remove(self, node: Node) -> int:
        """Take one leaf out of the tree; returns the pages that became free."""
        if node.has_checkpoint:
            self.checkpoints.release(node)
            node.has_checkpoint = False
        for child in list(node.all_children()):
            self._remove(child)
        released = self.kv_pool.free(node)
        self._holders[node.page] -= 1
        if not self._holders[node.page]:
            del self._holders[node.page]
        siblings = node.parent.children if len(node.tokens) == self.page_size else node.parent.partials
        del siblings[node.tokens]
        self._nodes.discard(node)
        return released

    def flush(self) -> int:
        """Drop every page and checkpoint no running request uses; returns the pages freed."""
        freed = self.evict(self.kv_pool.num_pages)
        for node in list(self._nodes):
            if node.has_checkpoint:
                self.checkpoints.release(node)
                node.has_checkpoint = False
        return freed

    def check(self) -> None:
        """Raise AssertionError unless every node holds exactly its one page and the checkpoints agree."""
        holders: dict[int, int] = {}
        for node in self._nodes:
            assert self.kv_pool.pages(node) == [node.page], f"node at depth {node.depth} holds the wrong pages"
            siblings = node.parent.children if len(node.tokens) == self.page_size else node.parent.partials
            assert siblings.get(node.tokens) is node, "node detached from its parent"
            assert not node.partials or len(node.tokens) == self.page_size, "a partial node has children"
            holders[node.page] = holders.get(node.page, 0) + 1
            if self.checkpoints is not None:
                assert node.has_checkpoint == self.checkpoints.states.holds(node), "checkpoint flag disagrees"
        assert holders == self._holders, "page holder counts disagree"
        if self.checkpoints is not None:
            assert self.checkpoints.used_slots == sum(n.has_checkpoint for n in self._nodes), "checkpoint leaked"
